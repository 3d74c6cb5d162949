"""Validation rules of the Envelope, one scenario at a time.

Every refusal names the offending field and the (language-neutral) rule, the
same names the conformance vectors use.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kombu_envelope.envelope import (
    DEFAULT_LIMITS,
    MAX_RETRIES_DEFAULT,
    MAX_SAFE_INTEGER,
    PRIORITY_DEFAULT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Envelope,
    Limits,
    check_publishable,
    format_rfc3339,
    parse_rfc3339,
    rule_name,
)
from kombu_envelope.errors import InvalidEnvelope, Violation

#: The identity fields every Envelope on the wire carries, as JSON members.
IDENTITY_JSON = '"task_id": "i", "trace_id": "t", "created_at": "2025-09-11T04:40:00Z", '

NOW = datetime(2025, 9, 11, 4, 45, tzinfo=timezone.utc)
PLUS_8 = timezone(timedelta(hours=8))


def refusal(limits: Limits | None = None, **fields: Any) -> tuple[str, str]:
    """The (field, rule) of the single violation ``fields`` commit."""
    fields.setdefault("task_type", "send_email")
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.new(limits, **fields)
    assert len(caught.value.violations) == 1, caught.value.violations
    (violation,) = caught.value.violations
    return violation.field, violation.rule


def envelope(**fields: Any) -> Envelope:
    fields.setdefault("task_type", "send_email")
    return Envelope.new(**fields)


def nested(depth: int) -> dict[str, Any]:
    """A payload nested ``depth`` levels deep, the payload object being level 1."""
    value: dict[str, Any] = {}
    for level in range(depth, 1, -1):
        value = {f"l{level}": value}
    return value


# --- defaults ---------------------------------------------------------------


def test_a_minimal_envelope_gets_every_default() -> None:
    before = datetime.now(timezone.utc)
    env = Envelope.new(task_type="send_email")
    after = datetime.now(timezone.utc)

    assert uuid.UUID(env.task_id).version == 4
    assert re.fullmatch(r"[0-9a-f]{32}", env.trace_id)
    assert env.created_at.tzinfo is not None
    assert env.created_at.utcoffset() == timedelta(0)
    assert before <= env.created_at <= after
    assert env.payload == {}
    assert env.payload_version == 1
    assert env.priority == PRIORITY_DEFAULT
    assert env.max_retries == MAX_RETRIES_DEFAULT
    assert env.retry_count == 0
    assert env.schedule_time is None
    assert env.timeout_ms is None
    assert env.idempotency_key is None
    assert env.headers == {}
    assert env.ext == {}


def test_every_new_envelope_gets_its_own_task_and_trace_ids() -> None:
    first, second = envelope(), envelope()
    assert first.task_id != second.task_id
    assert first.trace_id != second.trace_id


def test_created_at_defaults_are_written_in_utc_with_z() -> None:
    assert json.loads(envelope().to_json())["created_at"].endswith("Z")


def test_a_missing_task_type_is_refused() -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.new()
    assert caught.value.fields == ["task_type"]
    assert caught.value.rules == ["required"]


# --- timestamps -------------------------------------------------------------


def test_a_naive_datetime_is_refused() -> None:
    assert refusal(created_at=datetime(2025, 9, 11, 12, 45)) == ("created_at", "timezone_required")
    assert refusal(schedule_time=datetime(2025, 9, 11, 12, 45)) == (
        "schedule_time", "timezone_required"
    )


@pytest.mark.parametrize(
    "epoch",
    [1757565900, 1757565900000, 1757565900.25, True],
    ids=["epoch_seconds_int", "epoch_milliseconds_int", "epoch_seconds_float", "boolean"],
)
def test_a_numeric_timestamp_is_refused(epoch: Any) -> None:
    assert refusal(schedule_time=epoch) == ("schedule_time", "type")
    assert refusal(created_at=epoch) == ("created_at", "type")


def test_a_numeric_string_timestamp_is_refused() -> None:
    assert refusal(schedule_time="1757565900") == ("schedule_time", "rfc3339")


@pytest.mark.parametrize(
    "text", ["2025-09-11T12:45:00", "2025-09-11T12:45:00.5", "2025-09-11t12:45:00.123456789"]
)
def test_a_string_without_offset_is_refused(text: str) -> None:
    assert refusal(schedule_time=text) == ("schedule_time", "timezone_required")


def test_plus_0800_is_accepted_and_preserved() -> None:
    env = envelope(schedule_time="2025-09-11T12:45:00+08:00",
                   created_at="2025-09-11T12:30:00.250000+08:00")
    assert env.schedule_time is not None
    assert env.schedule_time.utcoffset() == timedelta(hours=8)
    assert env.schedule_time == NOW
    wire = json.loads(env.to_json())
    assert wire["schedule_time"] == "2025-09-11T12:45:00+08:00"
    assert wire["created_at"] == "2025-09-11T12:30:00.250000+08:00"
    assert Envelope.parse(env.to_json()) == env


@pytest.mark.parametrize("text", ["2025-09-11T04:45:00Z", "2025-09-11t04:45:00z",
                                  "2025-09-11T04:45:00+00:00", "2025-09-11T04:45:00-00:00"])
def test_utc_is_accepted_in_every_spelling_and_written_with_z(text: str) -> None:
    env = envelope(schedule_time=text)
    assert env.schedule_time == NOW
    assert json.loads(env.to_json())["schedule_time"] == "2025-09-11T04:45:00Z"


def test_an_aware_datetime_is_accepted_with_its_offset() -> None:
    env = envelope(schedule_time=NOW.astimezone(PLUS_8))
    assert json.loads(env.to_json())["schedule_time"] == "2025-09-11T12:45:00+08:00"


def test_a_nanosecond_fraction_is_truncated_to_microseconds() -> None:
    env = envelope(created_at="2025-09-11T12:45:00.123456999+08:00")
    assert env.created_at.microsecond == 123456
    assert json.loads(env.to_json())["created_at"] == "2025-09-11T12:45:00.123456+08:00"


@pytest.mark.parametrize(
    "text",
    [
        "2025-09-11T12:45:00Z\n",
        "2025-09-11 12:45:00Z",
        "2025-09-11",
        "2025-09-11T12:45:00+0800",
        "2025-09-11T12:45:00+08",
        "2025-09-11T12:45:00.1234567891Z",
        "2025-13-11T12:45:00Z",
        "2025-02-30T12:45:00Z",
        "2025-09-11T24:00:00Z",
        "2016-12-31T23:59:60Z",
        "2025-09-11T12:45:00+24:00",
        "2025-09-11T12:45:00+05:60",
        "٢٠٢٥-09-11T12:45:00Z",
        "",
    ],
)
def test_a_malformed_timestamp_is_refused(text: str) -> None:
    assert refusal(created_at=text) == ("created_at", "rfc3339")


def test_a_null_created_at_is_refused_but_a_null_schedule_time_means_none() -> None:
    assert refusal(created_at=None) == ("created_at", "type")
    assert envelope(schedule_time=None).schedule_time is None


@pytest.mark.parametrize("text", ["0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00"])
def test_an_instant_outside_years_1_to_9999_in_utc_is_refused(text: str) -> None:
    assert refusal(schedule_time=text) == ("schedule_time", "rfc3339")


def test_a_sub_minute_offset_is_written_in_utc() -> None:
    odd = timezone(timedelta(hours=5, seconds=30))
    env = envelope(schedule_time=datetime(2025, 9, 11, 9, 45, 30, tzinfo=odd))
    assert json.loads(env.to_json())["schedule_time"] == "2025-09-11T04:45:00Z"
    assert format_rfc3339(datetime(2025, 9, 11, 9, 45, 30, tzinfo=odd)) == "2025-09-11T04:45:00Z"


def test_parse_rfc3339_and_format_rfc3339_are_inverse() -> None:
    text = "2025-09-11T07:15:00.000001-05:30"
    assert format_rfc3339(parse_rfc3339(text)) == text


# --- schedule and the maximum delay at publish ------------------------------


def test_a_schedule_more_than_90_days_ahead_is_refused_at_publish() -> None:
    env = envelope(schedule_time=NOW + timedelta(days=90, seconds=1))
    with pytest.raises(InvalidEnvelope) as caught:
        check_publishable(env, now=NOW)
    assert caught.value.fields == ["schedule_time"]
    assert caught.value.rules == ["max_delay"]


def test_a_schedule_exactly_90_days_ahead_is_publishable() -> None:
    assert DEFAULT_LIMITS.max_delay_s == 90 * 24 * 3600
    check_publishable(envelope(schedule_time=NOW + timedelta(days=90)), now=NOW)


def test_a_far_schedule_is_stored_fine_but_not_publishable() -> None:
    env = envelope(schedule_time="2125-01-01T00:00:00Z")
    assert Envelope.parse(env.to_json()) == env
    with pytest.raises(InvalidEnvelope):
        check_publishable(env, now=NOW)


def test_a_custom_max_delay_is_honoured() -> None:
    limits = Limits(max_delay_s=3600)
    check_publishable(envelope(schedule_time=NOW + timedelta(hours=1)), limits, now=NOW)
    with pytest.raises(InvalidEnvelope) as caught:
        check_publishable(envelope(schedule_time=NOW + timedelta(hours=2)), limits, now=NOW)
    assert caught.value.rules == ["max_delay"]
    check_publishable(envelope(schedule_time=NOW + timedelta(days=300)), Limits(max_delay_s=1e9),
                      now=NOW)


def test_a_past_schedule_is_publishable_and_due() -> None:
    env = envelope(schedule_time="2001-02-03T04:05:06Z")
    check_publishable(env, now=NOW)
    check_publishable(env)
    assert env.is_due(NOW)
    assert env.is_due()


def test_an_unscheduled_envelope_is_publishable_and_due_now() -> None:
    env = envelope()
    check_publishable(env)
    assert env.is_due()
    assert abs(env.due_ms() - datetime.now(timezone.utc).timestamp() * 1000) < 60_000


def test_a_future_schedule_is_not_due_until_its_time() -> None:
    env = envelope(schedule_time=NOW)
    assert not env.is_due(NOW - timedelta(microseconds=1))
    assert env.is_due(NOW)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("1970-01-01T00:00:00.0019Z", 1),
        ("1970-01-01T08:00:00.999999+08:00", 999),
        ("1969-12-31T23:59:59.9995Z", -1),
        ("2025-09-11T12:45:00.001+08:00", 1757565900001),
    ],
)
def test_due_ms_is_exact_milliseconds_since_the_epoch(text: str, expected: int) -> None:
    assert envelope(schedule_time=text).due_ms() == expected


# --- payload ----------------------------------------------------------------


def test_a_payload_five_levels_deep_is_accepted() -> None:
    assert envelope(payload=nested(5)).payload == nested(5)
    envelope(payload={"a": [[[{"x": 1}]]]})


def test_a_payload_six_levels_deep_is_refused() -> None:
    assert refusal(payload=nested(6)) == ("payload", "max_depth")
    assert refusal(payload={"a": [[[[[1]]]]]}) == ("payload", "max_depth")


def test_a_custom_payload_depth_is_honoured() -> None:
    limits = Limits(max_payload_depth=3)
    Envelope.new(limits, task_type="t", payload=nested(3))
    assert refusal(limits, payload=nested(4)) == ("payload", "max_depth")
    Envelope.new(Limits(max_payload_depth=8), task_type="t", payload=nested(8))


def test_a_payload_of_exactly_the_size_limit_is_accepted() -> None:
    blob = "x" * (DEFAULT_LIMITS.max_payload_bytes - len('{"blob":""}'))
    envelope(payload={"blob": blob})


def test_a_payload_one_byte_over_the_size_limit_is_refused() -> None:
    blob = "x" * (DEFAULT_LIMITS.max_payload_bytes - len('{"blob":""}') + 1)
    assert refusal(payload={"blob": blob}) == ("payload", "max_bytes")


def test_the_payload_size_counts_utf8_bytes_of_compact_json() -> None:
    limits = Limits(max_payload_bytes=20)
    Envelope.new(limits, task_type="t", payload={"k": "éééé"})  # {"k":"éééé"} = 16 bytes
    Envelope.new(limits, task_type="t", payload={"k": "éééééé"})  # 20 bytes: at the limit
    assert refusal(limits, payload={"k": "ééééééé"}) == ("payload", "max_bytes")  # 22 bytes


@pytest.mark.parametrize(
    "value",
    [NOW, {1, 2}, math.nan, math.inf, -math.inf, b"bytes", (1, 2), object(), "\ud800"],
    ids=["datetime", "set", "nan", "inf", "-inf", "bytes", "tuple", "object", "lone_surrogate"],
)
def test_a_python_value_json_cannot_hold_is_refused_in_the_payload(value: Any) -> None:
    assert refusal(payload={"value": value}) == ("payload", "json_value")
    assert refusal(payload={"deeper": [{"value": value}]}) == ("payload", "json_value")


def test_a_non_string_key_deep_in_the_payload_is_refused() -> None:
    assert refusal(payload={"a": {1: "one"}}) == ("payload", "json_value")


def test_a_payload_that_is_not_an_object_is_refused() -> None:
    assert refusal(payload=[1, 2]) == ("payload", "type")
    assert refusal(payload="{}") == ("payload", "type")
    assert refusal(payload=None) == ("payload", "type")


def test_nan_in_json_text_is_refused() -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.parse("{" + IDENTITY_JSON + '"task_type": "t", "payload": {"x": NaN}}')
    assert caught.value.rules == ["json_value"]


# --- retries ----------------------------------------------------------------


def test_a_retry_count_above_max_retries_is_refused() -> None:
    assert refusal(max_retries=2, retry_count=3) == ("retry_count", "retry_count_le_max_retries")


def test_the_default_max_retries_bounds_the_retry_count() -> None:
    envelope(retry_count=MAX_RETRIES_DEFAULT)
    assert refusal(retry_count=MAX_RETRIES_DEFAULT + 1) == (
        "retry_count", "retry_count_le_max_retries"
    )


def test_a_retry_count_equal_to_max_retries_is_accepted() -> None:
    envelope(max_retries=0, retry_count=0)
    envelope(max_retries=7, retry_count=7)


def test_max_retries_none_means_unlimited_and_survives_the_wire() -> None:
    env = envelope(max_retries=None, retry_count=10_000)
    assert json.loads(env.to_json())["max_retries"] is None
    assert Envelope.parse(env.to_json()) == env


def test_negative_retries_are_refused() -> None:
    assert refusal(max_retries=-1) == ("max_retries", "range")
    assert refusal(retry_count=-1) == ("retry_count", "range")


# --- integers ---------------------------------------------------------------


@pytest.mark.parametrize("priority", [PRIORITY_MIN, 1, PRIORITY_DEFAULT, PRIORITY_MAX])
def test_a_priority_from_0_to_255_is_accepted(priority: int) -> None:
    assert envelope(priority=priority).priority == priority


@pytest.mark.parametrize("priority", [-1, 256, 10**6])
def test_a_priority_out_of_range_is_refused(priority: int) -> None:
    assert refusal(priority=priority) == ("priority", "range")


@pytest.mark.parametrize("priority", [1.5, 100.0, "200", "high", True, None])
def test_a_priority_that_is_not_an_integer_is_refused(priority: Any) -> None:
    assert refusal(priority=priority) == ("priority", "type")


@pytest.mark.parametrize("field", ["payload_version", "timeout_ms", "retry_count"])
def test_integers_above_2_53_are_refused(field: str) -> None:
    fields: dict[str, Any] = {field: MAX_SAFE_INTEGER + 1, "max_retries": None}
    assert refusal(**fields) == (field, "range")
    fields[field] = MAX_SAFE_INTEGER
    envelope(**fields)


def test_zero_payload_version_and_timeout_are_refused() -> None:
    assert refusal(payload_version=0) == ("payload_version", "range")
    assert refusal(timeout_ms=0) == ("timeout_ms", "range")


def test_an_integral_float_in_json_text_is_refused() -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.parse("{" + IDENTITY_JSON + '"task_type": "t", "priority": 1e2}')
    assert (caught.value.fields, caught.value.rules) == (["priority"], ["type"])


# --- names and ids ----------------------------------------------------------


@pytest.mark.parametrize(
    "task_type",
    ["send_email", "_private", "billing.charge-card", "a.b.c.d", "v2.Tasks_9.x-y", "t" * 255],
)
def test_a_task_type_matching_the_pattern_is_accepted(task_type: str) -> None:
    assert envelope(task_type=task_type).task_type == task_type


@pytest.mark.parametrize(
    "task_type",
    ["1task", "-task", "a..b", "a.", ".a", "send email", "tasks:add", "tâche", "a.1b",
     "send_email\n"],
)
def test_a_task_type_not_matching_the_pattern_is_refused(task_type: str) -> None:
    assert refusal(task_type=task_type) == ("task_type", "pattern")


def test_a_task_type_of_wrong_length_or_type_is_refused() -> None:
    assert refusal(task_type="") == ("task_type", "length")
    assert refusal(task_type="t" * 256) == ("task_type", "length")
    assert refusal(task_type=42) == ("task_type", "type")


def test_task_and_trace_ids_are_printable_ascii_tokens() -> None:
    envelope(task_id="celery-task:1/2?x=y", trace_id="00-abc-01")
    assert refusal(task_id="task 1") == ("task_id", "pattern")
    assert refusal(task_id="tâche") == ("task_id", "pattern")
    assert refusal(task_id="") == ("task_id", "length")
    assert refusal(task_id=123) == ("task_id", "type")
    assert refusal(trace_id="a" * 129) == ("trace_id", "length")


def test_an_idempotency_key_is_non_empty_text_of_at_most_512_characters() -> None:
    envelope(idempotency_key="ключ-" + "k" * 507)
    assert refusal(idempotency_key="") == ("idempotency_key", "length")
    assert refusal(idempotency_key="k" * 513) == ("idempotency_key", "length")
    assert refusal(idempotency_key="\udcff") == ("idempotency_key", "json_value")


# --- unknown fields, headers, ext -------------------------------------------


def test_an_unknown_field_is_refused() -> None:
    assert refusal(color="blue") == ("color", "unknown_field")
    assert refusal(args=[1, 2]) == ("args", "unknown_field")


def test_headers_map_strings_to_strings() -> None:
    assert envelope(headers={"a": "1", "empty": ""}).headers == {"a": "1", "empty": ""}
    assert refusal(headers={"x-attempt": 2}) == ("headers.x-attempt", "type")
    assert refusal(headers={"x": None}) == ("headers.x", "type")
    assert refusal(headers={"x": ["a"]}) == ("headers.x", "type")
    assert refusal(headers=["a"]) == ("headers", "type")
    assert refusal(headers={"x": "\ud800"}) == ("headers", "json_value")


@pytest.mark.parametrize("namespace", ["celery", "com.example.billing", "node_1", "a-b"])
def test_an_ext_namespace_matching_the_pattern_is_accepted(namespace: str) -> None:
    assert envelope(ext={namespace: {"k": [1, {"v": None}]}}).ext == {
        namespace: {"k": [1, {"v": None}]}
    }


@pytest.mark.parametrize("namespace", ["Celery", "1x", "_x", "", "with space", ".x"])
def test_an_ext_namespace_not_matching_the_pattern_is_refused(namespace: str) -> None:
    assert refusal(ext={namespace: {}}) == (f"ext.{namespace}", "pattern")


def test_an_ext_namespace_holds_a_json_object() -> None:
    assert refusal(ext={"celery": "chord"}) == ("ext.celery", "type")
    assert refusal(ext={"celery": {"when": NOW}}) == ("ext", "json_value")


# --- reporting and serialisation --------------------------------------------


def test_every_violation_is_reported_with_field_and_rule() -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.parse({"task_type": "1x", "priority": 300, "color": "blue",
                        "created_at": 1757565900, "task_id": "i", "trace_id": "t"})
    found = set(zip(caught.value.fields, caught.value.rules))
    assert found == {("task_type", "pattern"), ("priority", "range"),
                     ("created_at", "type"), ("color", "unknown_field")}
    assert all(isinstance(v, Violation) and v.message for v in caught.value.violations)
    assert "priority" in str(caught.value)


@pytest.mark.parametrize("data", ["[]", '"x"', "null", "42"])
def test_json_text_that_is_not_an_object_is_refused(data: str) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.parse(data)
    assert (caught.value.fields, caught.value.rules) == (["envelope"], ["type"])


@pytest.mark.parametrize("data", ['{"task_type":', b'{"task_type":"\xff"}', b"", "\ufeff{}"])
def test_text_that_is_not_json_is_refused(data: str | bytes) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.parse(data)
    assert (caught.value.fields, caught.value.rules) == (["envelope"], ["json"])


def test_parse_accepts_json_text_bytes_and_mappings_alike() -> None:
    text = ('{"task_type": "t", "task_id": "x", "trace_id": "y",'
            ' "created_at": "2025-09-11T04:45:00Z"}')
    assert Envelope.parse(text) == Envelope.parse(text.encode()) == Envelope.parse(json.loads(text))


def test_to_json_is_compact_and_leaves_out_null_optional_fields() -> None:
    env = envelope(schedule_time=None, timeout_ms=None, idempotency_key=None)
    wire = env.to_json()
    assert b" " not in wire
    assert set(json.loads(wire)) == {
        "task_id", "task_type", "payload_version", "payload", "max_retries", "retry_count",
        "priority", "trace_id", "created_at", "headers", "ext",
    }
    assert Envelope.parse(wire) == env
    assert Envelope.parse(wire).to_json() == wire


def test_pydantic_error_types_map_to_neutral_rule_names() -> None:
    assert rule_name("missing") == "required"
    assert rule_name("extra_forbidden") == "unknown_field"
    assert rule_name("string_pattern_mismatch") == "pattern"
    assert rule_name("less_than_equal") == "range"
    assert rule_name("int_type") == "type"
    assert rule_name("json_invalid") == "json"
    assert rule_name("max_depth") == "max_depth"


def test_invalid_envelope_keeps_its_message_and_violations_through_pickle() -> None:
    """A prefork pool sends a task's exception to its parent pickled."""
    error = InvalidEnvelope([Violation("payload", "max_depth", "nested deeper than 5 levels")])
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) == \
        "invalid envelope: payload: nested deeper than 5 levels [max_depth]"
    assert copy.violations == error.violations
    rebuilt = InvalidEnvelope(str(error))  # from its message alone
    assert str(rebuilt) == str(error) and rebuilt.violations == []
    assert str(pickle.loads(pickle.dumps(rebuilt))) == str(error)
