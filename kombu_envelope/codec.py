"""Envelope <-> stream entry fields.

A task stream entry has three fields (all values are byte strings)::

    v     wire format version, "1"
    enc   "json" or "json+gzip"
    body  the Envelope as UTF-8 JSON, gzip-compressed when enc says so

A body (after inflating) may be at most :func:`max_body_bytes` long: the
payload limit plus room for the other fields. Writers refuse larger Envelopes
and readers treat larger bodies as malformed, so whatever one side writes the
other can read.

Entries may carry further fields (``n``, the number of times the entry was
redelivered after its consumer died, and ``r``, the number of times a live
consumer put it back); readers ignore fields they do not know. A reader that
meets a ``v`` it does not support treats the entry as malformed, so a later
format never gets misread.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Mapping
from typing import Any

from kombu_envelope.envelope import DEFAULT_LIMITS, Envelope, Limits
from kombu_envelope.errors import InvalidEnvelope, MalformedEntry, Violation

#: Wire format version written by this library.
WIRE_VERSION = "1"
ENC_JSON = "json"
ENC_JSON_GZIP = "json+gzip"

#: Bodies of at least this many bytes (of JSON) are gzip-compressed by default.
DEFAULT_GZIP_MIN_BYTES = 8192

#: Entry field names.
F_VERSION = "v"
F_ENCODING = "enc"
F_BODY = "body"
F_REDELIVERIES = "n"
F_REQUEUES = "r"

#: Room for the fields other than ``payload`` in a body (headers, ext, ids...).
BODY_OVERHEAD_BYTES = 256 * 1024


def max_body_bytes(limits: Limits = DEFAULT_LIMITS) -> int:
    """Largest body (uncompressed JSON) written or read: a gzip bomb is malformed input."""
    return limits.max_payload_bytes + BODY_OVERHEAD_BYTES


def encode_body(
    envelope: Envelope,
    gzip_min_bytes: int | None = DEFAULT_GZIP_MIN_BYTES,
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[str, bytes]:
    """Return ``(enc, body)`` for ``envelope``; gzip when the JSON reaches the threshold.

    ``gzip_min_bytes=None`` never compresses, nor does an Envelope with an
    ``ordering_key`` (the scripts read it from the body). An Envelope whose JSON is longer
    than :func:`max_body_bytes` raises :class:`InvalidEnvelope`.
    """
    body = envelope.to_json()
    limit = max_body_bytes(limits)
    if len(body) > limit:
        raise InvalidEnvelope([
            Violation(
                field="envelope",
                rule="max_bytes",
                message=f"the Envelope is {len(body)} bytes of JSON, above the limit of {limit}",
            )
        ])
    if (gzip_min_bytes is not None and len(body) >= gzip_min_bytes
            and envelope.ordering_key is None):
        return ENC_JSON_GZIP, gzip.compress(body, compresslevel=6, mtime=0)
    return ENC_JSON, body


def encode_entry(
    envelope: Envelope,
    gzip_min_bytes: int | None = DEFAULT_GZIP_MIN_BYTES,
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> dict[str, bytes | str]:
    """The fields of the stream entry that stores ``envelope``."""
    enc, body = encode_body(envelope, gzip_min_bytes, limits=limits)
    return {F_VERSION: WIRE_VERSION, F_ENCODING: enc, F_BODY: body}


def _field(fields: Mapping[Any, Any], name: str) -> bytes:
    try:
        value = fields.get(name.encode())
        if value is None:
            value = fields.get(name)
    except Exception as exc:  # a mapping that refuses bytes or str keys (e.g. os.environ)
        raise MalformedEntry(f"cannot read field {name!r}: {exc!r}") from exc
    if value is None:
        raise MalformedEntry(f"missing field {name!r}")
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise MalformedEntry(f"field {name!r} is not a string")


def _inflate(body: bytes, limits: Limits) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    max_bytes = max_body_bytes(limits)
    try:
        data = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise MalformedEntry(f"body is not valid gzip: {exc}") from exc
    if len(data) > max_bytes or inflater.unconsumed_tail:
        raise MalformedEntry(f"body too large: gzip body inflates beyond {max_bytes} bytes")
    if not inflater.eof:
        raise MalformedEntry("body is not valid gzip: the gzip stream is truncated")
    if inflater.unused_data:
        raise MalformedEntry("body is not valid gzip: data after the end of the gzip stream")
    return data


def decode_body(enc: bytes | str, body: bytes, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Decode a body written with encoding ``enc``; raise :class:`MalformedEntry`."""
    enc_text = enc.decode("utf-8", "replace") if isinstance(enc, bytes) else enc
    if enc_text == ENC_JSON_GZIP:
        body = _inflate(body, limits)
    elif enc_text != ENC_JSON:
        raise MalformedEntry(f"unknown encoding {enc_text!r}")
    elif len(body) > max_body_bytes(limits):
        raise MalformedEntry(
            f"body too large: {len(body)} bytes, above the limit of {max_body_bytes(limits)}"
        )
    try:
        return Envelope.parse(body, limits)
    except InvalidEnvelope as exc:
        raise MalformedEntry(str(exc), exc.violations) from exc


def decode_entry(fields: Any, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Decode stream entry fields into an Envelope; raise :class:`MalformedEntry`.

    Any input whatsoever yields either an Envelope or :class:`MalformedEntry`.
    """
    if not isinstance(fields, Mapping):
        raise MalformedEntry("entry is not a field/value mapping")
    version = _field(fields, F_VERSION)
    if version != WIRE_VERSION.encode():
        raise MalformedEntry(
            f"unsupported wire version {version.decode('utf-8', 'replace')!r}"
        )
    return decode_body(_field(fields, F_ENCODING), _field(fields, F_BODY), limits)
