"""``Envelope.to_json`` writes exactly what pydantic's serializer of the model writes.

The canonical form is the model's ``model_dump_json`` with the fields whose default is
``null`` left out when they are ``null``; ``to_json`` builds it without pydantic's field
filter, so every kind of value is compared here byte for byte.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given

from kombu_envelope.envelope import MAX_SAFE_INTEGER, Envelope
from tests.test_codec import PROPERTY, valid_envelopes

IDENTITY = {
    "task_id": "7f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
    "task_type": "reports.render",
    "trace_id": "0af7651916cd43dd8448eb211c80319c",
    "created_at": "2025-09-11T12:45:00+08:00",
}


def canonical(envelope: Envelope) -> bytes:
    """The model's own serialization, null-by-default fields left out when null."""
    left_out = {name for name, info in Envelope.model_fields.items()
                if info.default is None and getattr(envelope, name) is None}
    return envelope.model_dump_json(exclude=left_out).encode()


EXAMPLES: dict[str, dict[str, Any]] = {
    "defaults only": {},
    "unicode": {
        "payload": {"名前": "Zoë 👩‍💻", "quote": 'say "hi"\\', "controls": "\x00\x1f\x7f\n\t",
                    "separators": "\u2028\u2029", "bmp edge": "\uffff\U0010ffff"},
        "headers": {"x-note": "é\u00a0ü", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    },
    "nested payload and nulls": {
        "payload": {"a": {"b": [{"c": [None, True, False, 0, -1]}]}, "none": None,
                    "empty": {}, "list": []},
    },
    "numbers": {
        "payload": {"floats": [0.1, -0.0, 1e16, 1e-7, 123456789.125, 5e-324,
                               1.7976931348623157e308],
                    "ints": [MAX_SAFE_INTEGER, -(2**63), 2**64, 2**70]},
        "payload_version": MAX_SAFE_INTEGER, "retry_count": 2, "max_retries": 7,
        "priority": 255, "timeout_ms": 1,
    },
    "unlimited retries": {"max_retries": None, "retry_count": 12},
    "schedule and expiry with offsets": {
        "schedule_time": datetime(2025, 9, 11, 4, 45, 0, 123456, tzinfo=timezone.utc),
        "expires": "2025-09-12T00:00:00.5-05:30",
        "created_at": datetime(2025, 9, 11, 4, 40, tzinfo=timezone(timedelta(hours=14))),
    },
    "an offset that is not whole minutes": {
        "created_at": datetime(2025, 9, 11, 4, 40, tzinfo=timezone(timedelta(seconds=30))),
        "schedule_time": "2025-09-11t04:41:00.123456789z",
    },
    "every optional field": {
        "payload": {"order_id": 1}, "schedule_time": "2025-09-11T12:45:00Z",
        "timeout_ms": 30_000, "expires": "2025-09-11T13:45:00+00:00",
        "idempotency_key": "order:1 ✓", "headers": {"a": "", "b": "c"},
        "ext": {"celery": {"argnames": ["x"], "args": [1, [2, {"d": None}]]},
                "acme.billing": {}},
    },
}


@pytest.mark.parametrize("fields", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_to_json_is_the_models_own_serialization(fields: dict[str, Any]) -> None:
    envelope = Envelope.new(**{**IDENTITY, **fields})
    assert envelope.to_json() == canonical(envelope)


def test_a_new_envelope_with_generated_fields_is_written_the_same() -> None:
    envelope = Envelope.new(task_type="t", payload={"k": "v"})
    assert envelope.to_json() == canonical(envelope)


@PROPERTY
@given(valid_envelopes())
def test_every_valid_envelope_is_written_as_the_model_writes_it(envelope: Envelope) -> None:
    assert envelope.to_json() == canonical(envelope)


def test_a_copy_with_changed_fields_is_written_as_the_model_writes_it() -> None:
    envelope = Envelope.new(**IDENTITY, payload={"k": [1, 2]})
    changed = envelope.model_copy(update={
        "retry_count": 1, "schedule_time": datetime(2025, 9, 11, 5, 0, tzinfo=timezone.utc),
        "max_retries": None})
    assert changed.to_json() == canonical(changed)
    assert b'"schedule_time":"2025-09-11T05:00:00Z"' in changed.to_json()
