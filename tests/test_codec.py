"""Stream entry codec: Envelope <-> ``{v, enc, body}`` fields.

Property tests check that every valid Envelope survives the wire byte for
byte, and that no input whatsoever makes the decoder raise anything but
:class:`MalformedEntry`.
"""

from __future__ import annotations

import gzip
import json
import string
import zlib
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.exceptions import DecodeError, EncodeError

from kombu_envelope.codec import (
    DEFAULT_GZIP_MIN_BYTES,
    ENC_JSON,
    ENC_JSON_GZIP,
    F_BODY,
    F_ENCODING,
    F_REDELIVERIES,
    F_VERSION,
    WIRE_VERSION,
    decode_body,
    decode_entry,
    encode_body,
    encode_entry,
    max_body_bytes,
)
from kombu_envelope.envelope import (
    DEFAULT_LIMITS,
    MAX_SAFE_INTEGER,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Envelope,
    Limits,
    format_rfc3339,
)
from kombu_envelope.errors import InvalidEnvelope, MalformedEntry

GZIP_MAGIC = b"\x1f\x8b"


def sample(**fields: Any) -> Envelope:
    base: dict[str, Any] = {
        "task_id": "7f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
        "task_type": "reports.render",
        "payload": {"report": "weekly", "week": 37},
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "created_at": "2025-09-11T12:45:00+08:00",
    }
    return Envelope.new(**{**base, **fields})


def as_redis_returns(fields: Mapping[str, bytes | str]) -> dict[bytes, bytes]:
    """Fields as redis-py returns them: bytes names, bytes values."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def entry(enc: str, body: bytes, **more: bytes | str) -> dict[str, bytes | str]:
    return {F_VERSION: WIRE_VERSION, F_ENCODING: enc, F_BODY: body, **more}


# --- examples ---------------------------------------------------------------


def test_a_small_envelope_round_trips_as_plain_json() -> None:
    env = sample()
    fields = encode_entry(env)
    assert fields == {F_VERSION: "1", F_ENCODING: ENC_JSON, F_BODY: env.to_json()}
    assert decode_entry(fields) == env
    assert decode_entry(as_redis_returns(fields)) == env


def test_a_body_at_the_gzip_threshold_is_compressed_and_flagged() -> None:
    env = sample(payload={"blob": "abc" * 5000})
    enc, body = encode_body(env)
    assert len(env.to_json()) >= DEFAULT_GZIP_MIN_BYTES
    assert enc == ENC_JSON_GZIP == "json+gzip"
    assert body.startswith(GZIP_MAGIC)
    assert len(body) < len(env.to_json())
    assert gzip.decompress(body) == env.to_json()
    assert decode_entry(as_redis_returns(encode_entry(env))) == env


def test_the_gzip_threshold_is_inclusive() -> None:
    env = sample()
    size = len(env.to_json())
    assert encode_body(env, gzip_min_bytes=size)[0] == ENC_JSON_GZIP
    assert encode_body(env, gzip_min_bytes=size + 1)[0] == ENC_JSON


def test_gzip_threshold_none_never_compresses() -> None:
    env = sample(payload={"blob": "x" * 900_000})
    enc, body = encode_body(env, gzip_min_bytes=None)
    assert (enc, body) == (ENC_JSON, env.to_json())
    assert decode_entry(encode_entry(env, gzip_min_bytes=None)) == env


def test_compression_is_deterministic() -> None:
    env = sample(payload={"blob": "abc" * 5000})
    assert encode_entry(env) == encode_entry(env)


@pytest.mark.parametrize("names", [str, bytes], ids=["str_names", "bytes_names"])
@pytest.mark.parametrize("values", [str, bytes], ids=["str_values", "bytes_values"])
def test_field_names_and_values_may_be_str_or_bytes(names: type, values: type) -> None:
    env = sample()

    def convert(text: str, kind: type) -> str | bytes:
        return text if kind is str else text.encode()

    fields = {
        convert(F_VERSION, names): convert("1", values),
        convert(F_ENCODING, names): convert("json", values),
        convert(F_BODY, names): convert(env.to_json().decode(), values),
    }
    assert decode_entry(fields) == env


def test_a_bytearray_body_is_accepted() -> None:
    env = sample()
    assert decode_entry(entry(ENC_JSON, bytearray(env.to_json()))) == env  # type: ignore[arg-type]


def test_unknown_fields_are_ignored() -> None:
    env = sample()
    fields = {**encode_entry(env), F_REDELIVERIES: "3", "x-future": b"\x00\xff"}
    assert decode_entry(fields) == env


def test_decode_body_takes_the_encoding_as_str_or_bytes() -> None:
    env = sample()
    assert decode_body("json", env.to_json()) == env
    assert decode_body(b"json+gzip", gzip.compress(env.to_json())) == env


# --- malformed entries ------------------------------------------------------


def malformed(fields: Any, limits: Limits = DEFAULT_LIMITS) -> MalformedEntry:
    with pytest.raises(MalformedEntry) as caught:
        decode_entry(fields, limits)
    return caught.value


@pytest.mark.parametrize("version", ["2", "0", "", "1.0", " 1", "v1", b"\xff"])
def test_an_unknown_wire_version_is_malformed(version: str | bytes) -> None:
    fields = {**encode_entry(sample()), F_VERSION: version}
    assert "version" in malformed(fields).reason


@pytest.mark.parametrize("enc", ["zstd", "JSON", "gzip", "json+zstd", "", b"\xffjson"])
def test_an_unknown_encoding_is_malformed(enc: str | bytes) -> None:
    fields = {**encode_entry(sample()), F_ENCODING: enc}
    assert "unknown encoding" in malformed(fields).reason


@pytest.mark.parametrize("missing", [F_VERSION, F_ENCODING, F_BODY])
def test_a_missing_field_is_malformed(missing: str) -> None:
    fields = as_redis_returns(encode_entry(sample()))
    del fields[missing.encode()]
    assert f"missing field {missing!r}" in malformed(fields).reason


@pytest.mark.parametrize("value", [1, 1.0, None, ["1"], {"v": "1"}])
def test_a_field_that_is_not_a_string_is_malformed(value: Any) -> None:
    fields: dict[str, Any] = {**encode_entry(sample()), F_VERSION: value}
    malformed(fields)


@pytest.mark.parametrize("fields", [None, "v=1", b"", 42, [("v", "1")], object()])
def test_something_that_is_not_a_mapping_is_malformed(fields: Any) -> None:
    assert "mapping" in malformed(fields).reason


def test_a_plain_body_flagged_as_gzip_is_malformed() -> None:
    assert "gzip" in malformed(entry(ENC_JSON_GZIP, sample().to_json())).reason


def test_a_gzip_body_flagged_as_json_is_malformed() -> None:
    error = malformed(entry(ENC_JSON, gzip.compress(sample().to_json())))
    assert [(v.field, v.rule) for v in error.violations] == [("envelope", "json")]


@pytest.mark.parametrize("cut", [1, 4, 8, 12, 30])
def test_a_truncated_gzip_body_is_malformed(cut: int) -> None:
    body = gzip.compress(sample().to_json())
    assert "gzip" in malformed(entry(ENC_JSON_GZIP, body[:-cut])).reason


def test_a_gzip_body_with_a_bad_checksum_is_malformed() -> None:
    body = bytearray(gzip.compress(sample().to_json()))
    body[-8] ^= 0x01
    assert "gzip" in malformed(entry(ENC_JSON_GZIP, bytes(body))).reason


def test_data_after_the_gzip_stream_is_malformed() -> None:
    body = gzip.compress(sample().to_json())
    assert "gzip" in malformed(entry(ENC_JSON_GZIP, body + b"x")).reason
    assert "gzip" in malformed(entry(ENC_JSON_GZIP, body + gzip.compress(b" "))).reason


def test_a_gzip_bomb_is_malformed() -> None:
    bomb = gzip.compress(b" " * (max_body_bytes() + 1))
    assert len(bomb) < 4096
    assert "too large" in malformed(entry(ENC_JSON_GZIP, bomb)).reason


def test_a_gzip_bomb_is_measured_against_the_readers_limits() -> None:
    limits = Limits(max_payload_bytes=1000)
    body = gzip.compress(b'{"task_id":"i","trace_id":"t","created_at":"2025-09-11T04:40:00Z",'
                         b'"task_type":"t","payload":{"x":"' + b"y" * 300_000 + b'"}}')
    assert "too large" in malformed(entry(ENC_JSON_GZIP, body), limits).reason
    assert decode_entry(entry(ENC_JSON_GZIP, body)).payload == {"x": "y" * 300_000}


def test_a_huge_plain_body_is_malformed() -> None:
    body = b'{"task_type":"t","payload":{"x":"' + b"y" * max_body_bytes() + b'"}}'
    assert "too large" in malformed(entry(ENC_JSON, body)).reason


def test_an_envelope_too_large_to_be_read_back_is_refused_at_encoding() -> None:
    env = sample(headers={"big": "h" * max_body_bytes()})
    with pytest.raises(InvalidEnvelope) as caught:
        encode_entry(env)
    assert (caught.value.fields, caught.value.rules) == (["envelope"], ["max_bytes"])
    encode_entry(env, limits=Limits(max_payload_bytes=2**21))


def test_a_body_breaking_an_envelope_rule_is_malformed_with_violations() -> None:
    body = json.dumps({**json.loads(sample().to_json()), "priority": 300}).encode()
    error = malformed(entry(ENC_JSON, body))
    assert [(v.field, v.rule) for v in error.violations] == [("priority", "range")]
    assert "priority" in error.reason


def test_malformed_entry_is_a_kombu_decode_error_and_invalid_envelope_an_encode_error() -> None:
    assert isinstance(malformed({}), DecodeError)
    assert issubclass(InvalidEnvelope, EncodeError)


# --- property: valid envelopes survive the wire byte for byte ---------------

TASK_TYPE_RE = r"[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*"
TOKEN_RE = r"[\x21-\x7e]+"
EXT_NAMESPACE_RE = r"[a-z][a-z0-9_.\-]*"

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_keys = st.text(max_size=10)


def json_values(levels: int) -> st.SearchStrategy[Any]:
    """JSON values holding at most ``levels`` nested objects/arrays."""
    if levels == 0:
        return json_scalars
    inner = json_values(levels - 1)
    return json_scalars | st.lists(inner, max_size=3) | st.dictionaries(json_keys, inner,
                                                                         max_size=3)


def payloads(depth: int = DEFAULT_LIMITS.max_payload_depth) -> st.SearchStrategy[dict[str, Any]]:
    """Payload objects at most ``depth`` levels deep (the payload is level 1)."""
    return st.dictionaries(json_keys, json_values(depth - 1), max_size=4)


offsets = st.integers(-(23 * 60 + 59), 23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
aware_datetimes = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2200, 12, 31), timezones=offsets
)


def rfc3339_text(when: datetime, extra_digits: str, lower_case: bool) -> str:
    """``when`` as RFC 3339 text, with fraction digits past microseconds and t/z spellings."""
    text = format_rfc3339(when)
    offset = "Z" if text.endswith("Z") else text[-6:]
    fraction = f".{when.microsecond:06d}{extra_digits}" if extra_digits or when.microsecond else ""
    text = when.strftime("%Y-%m-%dT%H:%M:%S") + fraction + offset
    return text.replace("T", "t").replace("Z", "z") if lower_case else text


# Timestamps as Python values or as RFC 3339 text with up to nine fraction digits.
timestamps = aware_datetimes | st.builds(
    rfc3339_text, aware_datetimes, st.sampled_from(["", "", "1", "789"]), st.booleans()
)
safe_ints = st.integers(0, MAX_SAFE_INTEGER)


@st.composite
def valid_envelopes(draw: st.DrawFn) -> Envelope:
    """Envelopes that satisfy every rule, with a random selection of optional fields."""
    fields: dict[str, Any] = {
        "task_type": draw(st.from_regex(TASK_TYPE_RE, fullmatch=True).filter(
            lambda name: len(name) <= 255)),
        "payload": draw(payloads()),
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "task_id": st.from_regex(TOKEN_RE, fullmatch=True).filter(lambda t: len(t) <= 255),
        "trace_id": st.from_regex(TOKEN_RE, fullmatch=True).filter(lambda t: len(t) <= 128),
        "payload_version": st.integers(1, MAX_SAFE_INTEGER),
        "schedule_time": st.none() | timestamps,
        "created_at": timestamps,
        "timeout_ms": st.none() | st.integers(1, MAX_SAFE_INTEGER),
        "max_retries": st.none() | safe_ints,
        "priority": st.integers(PRIORITY_MIN, PRIORITY_MAX),
        "idempotency_key": st.none() | st.text(min_size=1, max_size=40),
        "headers": st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=3),
        "ext": st.dictionaries(
            st.from_regex(EXT_NAMESPACE_RE, fullmatch=True),
            st.dictionaries(json_keys, json_values(3), max_size=3),
            max_size=2,
        ),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    max_retries = fields.get("max_retries", 3)
    if draw(st.booleans()):
        upper = MAX_SAFE_INTEGER if max_retries is None else max_retries
        fields["retry_count"] = draw(st.integers(0, upper))
    return Envelope.new(**fields)


gzip_thresholds = st.sampled_from([None, 0, 64, DEFAULT_GZIP_MIN_BYTES])
PROPERTY = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(env=valid_envelopes(), gzip_min_bytes=gzip_thresholds)
def test_every_valid_envelope_survives_the_wire_byte_for_byte(
    env: Envelope, gzip_min_bytes: int | None
) -> None:
    fields = encode_entry(env, gzip_min_bytes)
    decoded = decode_entry(as_redis_returns(fields))
    assert decoded == env
    assert encode_entry(decoded, gzip_min_bytes) == fields
    assert decoded.to_json() == env.to_json()
    assert decoded.due_ms() == env.due_ms() or env.schedule_time is None


@PROPERTY
@given(env=valid_envelopes())
def test_every_valid_envelope_survives_gzip(env: Envelope) -> None:
    fields = encode_entry(env, gzip_min_bytes=0)
    assert fields[F_ENCODING] == ENC_JSON_GZIP
    decoded = decode_entry(fields)
    assert decoded == env
    assert encode_entry(decoded, gzip_min_bytes=0) == fields


# --- property: junk never raises anything but MalformedEntry ----------------

texts_or_bytes = st.text(max_size=30) | st.binary(max_size=30)
any_json = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_keys, inner, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from([F_VERSION, F_ENCODING, F_BODY, "n", "x"])
either_kind = st.sampled_from([str.encode, lambda text: text])
encodings = st.sampled_from([ENC_JSON, ENC_JSON_GZIP])


def decodes_or_is_malformed(fields: Any) -> None:
    """Decoding yields a usable Envelope or MalformedEntry, never another exception."""
    try:
        env = decode_entry(fields)
    except MalformedEntry as exc:
        assert isinstance(exc.reason, str)
        return
    env.is_due()
    env.due_ms()
    assert Envelope.parse(env.to_json()) == env
    assert decode_entry(encode_entry(env)) == env


@settings(max_examples=200, deadline=None)
@given(
    fields=st.from_type(dict[bytes | str, bytes | str | int | float | None])
    | st.dictionaries(field_names.map(str.encode) | field_names | texts_or_bytes,
                      texts_or_bytes | st.integers() | st.none(), max_size=5)
)
def test_junk_fields_are_malformed(fields: dict[Any, Any]) -> None:
    with pytest.raises(MalformedEntry):
        decode_entry(fields)


@settings(max_examples=50, deadline=None)
@given(fields=st.from_type(object) | any_json | st.binary())
def test_anything_but_a_mapping_is_malformed(fields: Any) -> None:
    if isinstance(fields, Mapping):
        decodes_or_is_malformed(fields)
        return
    with pytest.raises(MalformedEntry):
        decode_entry(fields)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=200), enc=encodings, wrap=st.booleans())
def test_random_bytes_bodies_are_malformed(body: bytes, enc: str, wrap: bool) -> None:
    if wrap and enc == ENC_JSON_GZIP:
        body = gzip.compress(body)
    with pytest.raises(MalformedEntry):
        decode_entry(entry(enc, body))


@settings(max_examples=200, deadline=None)
@given(document=any_json, enc=encodings, kind=either_kind)
def test_random_json_documents_as_body_decode_or_are_malformed(
    document: Any, enc: str, kind: Any
) -> None:
    body = json.dumps(document).encode()
    if enc == ENC_JSON_GZIP:
        body = gzip.compress(body)
    decodes_or_is_malformed({kind(F_VERSION): kind("1"), kind(F_ENCODING): kind(enc),
                             kind(F_BODY): body})


ENVELOPE_FIELDS = [*Envelope.model_fields, "args", "kwargs", "raw"]


@settings(max_examples=200, deadline=None)
@given(
    env=valid_envelopes(),
    changes=st.dictionaries(
        st.sampled_from(ENVELOPE_FIELDS) | json_keys,
        st.just(...) | any_json | timestamps.map(
            lambda t: t if isinstance(t, str) else format_rfc3339(t)
        ) | st.text(string.digits + "-:.TZ+", max_size=35),
        min_size=1,
        max_size=3,
    ),
    enc=encodings,
)
def test_mutated_envelopes_decode_or_are_malformed(
    env: Envelope, changes: dict[str, Any], enc: str
) -> None:
    document = json.loads(env.to_json())
    for name, value in changes.items():
        if value is ...:
            document.pop(name, None)
        else:
            document[name] = value
    body = json.dumps(document).encode()
    if enc == ENC_JSON_GZIP:
        body = gzip.compress(body)
    decodes_or_is_malformed(entry(enc, body))


@settings(max_examples=100, deadline=None)
@given(env=valid_envelopes(), position=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_corrupted_gzip_bodies_decode_or_are_malformed(
    env: Envelope, position: int, byte: int
) -> None:
    body = bytearray(encode_body(env, gzip_min_bytes=0)[1])
    body[position % len(body)] = byte
    decodes_or_is_malformed(entry(ENC_JSON_GZIP, bytes(body)))


def test_deeply_nested_json_bodies_are_malformed() -> None:
    for body in (b"[" * 100_000, b'{"task_type":"t","payload":' + b'{"a":' * 5000 + b"1"
                 + b"}" * 5001):
        malformed(entry(ENC_JSON, body))
        malformed(entry(ENC_JSON_GZIP, zlib.compress(body)))
