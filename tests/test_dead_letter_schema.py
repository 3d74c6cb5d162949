"""Dead-letter entries written by this library match their model and JSON Schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import redis
from support import wait_for
from support.envelope_streams import connect

from kombu_envelope.dead_letter_entry import DeadLetterEntry, parse_dead_letter_fields
from kombu_envelope.keys import KeySpace
from kombu_envelope.schema import SCHEMA_DIR
from kombu_envelope.settings import Settings
from kombu_envelope.store.lease import reclaim_dead_consumers

QUEUE = "dlq-schema"


def _schema_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMA_DIR / "dead_letter.schema.json").read_text("utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _as_json(fields: dict[Any, Any]) -> dict[str, str]:
    """The entry as the JSON object the schema describes (every value a string)."""
    return {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()}


def _dead_entries(client: redis.Redis, prefix: str) -> list[dict[Any, Any]]:
    return [fields for _, fields in client.xrange(KeySpace(prefix).queue(QUEUE).dead)]


def test_a_malformed_entry_and_a_redelivery_limit_entry_match_the_schema(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    # Given a malformed entry consumed by a plain kombu consumer (dead_letter.lua) and an
    # entry whose consumer died too often (requeue.lua)
    keys = KeySpace(key_prefix).queue(QUEUE)
    settings = Settings(key_prefix=key_prefix, lease_ms=300, max_redeliveries=1)
    with connect(redis_url, key_prefix) as conn:
        conn.SimpleQueue(QUEUE).close()  # declares the groups
        redis_client.xadd(keys.task_streams[1], {"v": "1", "enc": "json", "body": b"\xff{"})
        simple = conn.SimpleQueue(QUEUE)
        with pytest.raises(simple.Empty):
            simple.get(timeout=0.5)
        simple.close()
    redis_client.xadd(keys.task_streams[1], {"v": "1", "enc": "json", "body": "{}"})
    redis_client.xreadgroup(settings.consumer_group, "gone", {keys.task_streams[1]: ">"})
    wait_for(lambda: reclaim_dead_consumers(redis_client, settings, QUEUE), timeout=5)

    # When their dead-letter entries are read back
    entries = wait_for(lambda: _dead_entries(redis_client, key_prefix)
                       if len(_dead_entries(redis_client, key_prefix)) == 2 else None)

    # Then each matches the pydantic model and the checked-in JSON Schema
    validator = _schema_validator()
    classes = set()
    for fields in entries:
        classes.add(parse_dead_letter_fields(fields).failure_class.value)
        assert list(validator.iter_errors(_as_json(fields))) == []
    assert classes == {"malformed_entry", "redelivery_limit"}


def test_an_unknown_field_is_refused_by_model_and_schema() -> None:
    fields = {"dlq": "1", "failure_class": "rejected", "reason": "r", "queue": "q",
              "dead_at": "2025-09-11T04:45:00Z", "language": "go", "host": "h", "pid": "1",
              "consumer": "c", "first_failure_at": "2025-09-11T04:45:00Z",
              "last_failure_at": "2025-09-11T04:45:00Z", "raw.body": "{}"}
    assert DeadLetterEntry.model_validate(fields).queue == "q"
    assert list(_schema_validator().iter_errors(fields)) == []
    with pytest.raises(ValueError, match="unknown dead-letter fields"):
        DeadLetterEntry.model_validate({**fields, "colour": "blue"})
    assert list(_schema_validator().iter_errors({**fields, "colour": "blue"}))
