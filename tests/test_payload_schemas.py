"""Payload schemas (docs/protocol.md, section 16) against a real Redis: the registry,
its cache, refusal at publish (Publisher, Celery's apply_async, dlq replay), dead
letters from a real ``celery worker``, and the ``schemas`` commands."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery
from celery.result import AsyncResult
from click.testing import CliRunner
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR, CeleryWorker

from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.errors import InvalidEnvelope, InvalidSchema
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket, KeySpace
from kombu_envelope.schemas_cli import schema_commands
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters, ReplayEdit, dead_letter_envelope
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.schemas import PayloadSchemas

QUEUE = "orders"
ORDER_SCHEMA = {
    "title": "close an order",
    "type": "object",
    "required": ["order_id"],
    "additionalProperties": False,
    "properties": {"order_id": {"type": "integer"}, "lines": {"type": "array", "items": {
        "type": "object", "properties": {"quantity": {"type": "integer", "minimum": 1}}}}},
}


def order(payload: dict[str, object], version: int = 1) -> Envelope:
    return Envelope.new(task_type="order.close", payload_version=version, payload=payload)


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def schemas(redis_client: redis.Redis, settings: Settings) -> PayloadSchemas:
    return PayloadSchemas(redis_client, settings)


def stored_tasks(client: redis.Redis, settings: Settings, queue: str = QUEUE) -> int:
    keys = settings.keys.queue(queue)
    return sum(client.xlen(stream) for stream in keys.task_streams) + client.zcard(keys.delayed)


# ---------------------------------------------------------------- registry


def test_register_get_all_and_delete(schemas: PayloadSchemas, redis_client: redis.Redis,
                                     settings: Settings) -> None:
    schemas.register("order.close", 1, ORDER_SCHEMA)
    schemas.register("order.close", 2, {"type": "object"})
    schemas.register("billing.charge", 1, {})
    assert json.loads(redis_client.hget(f"{settings.key_prefix}:schemas", "order.close@1")
                      ) == ORDER_SCHEMA
    assert schemas.get("order.close", 1) == ORDER_SCHEMA
    assert schemas.get("order.close", 3) is None
    assert list(schemas.all()) == [("billing.charge", 1), ("order.close", 1), ("order.close", 2)]
    schemas.register("order.close", 2, {"type": "object", "title": "replaced"})
    assert schemas.get("order.close", 2) == {"type": "object", "title": "replaced"}
    assert schemas.delete("order.close", 2) is True
    assert schemas.delete("order.close", 2) is False
    assert list(schemas.all()) == [("billing.charge", 1), ("order.close", 1)]


@pytest.mark.parametrize(("task_type", "version", "schema", "message"), [
    ("order.close", 1, {"type": "objectx"}, "not a valid draft 2020-12 schema: at #/type: "
                                            "'objectx' is not valid"),
    ("order.close", 1, {"properties": {"a": {"pattern": "("}}},
     "at #/properties/a/pattern: '(' is not a 'regex'"),
    ("order.close", 1, ["not", "an", "object"], "must be a JSON object, not list"),
    ("order.close", 1, {"$ref": "https://example.com/order.json"}, "cannot be resolved"),
    ("order.close", 1, {"$schema": "http://json-schema.org/draft-07/schema#"},
     "$schema must be https://json-schema.org/draft/2020-12/schema"),
    ("order close", 1, {}, "task_type 'order close' does not match"),
    ("order.close", 0, {}, "payload_version must be an integer >= 1, not 0"),
])
def test_register_refuses_what_is_not_a_valid_schema(
        schemas: PayloadSchemas, redis_client: redis.Redis, settings: Settings, task_type: str,
        version: int, schema: object, message: str) -> None:
    with pytest.raises(InvalidSchema) as refused:
        schemas.register(task_type, version, schema)  # type: ignore[arg-type]
    assert message in str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert redis_client.exists(settings.keys.schemas) == 0


def test_violations_are_cached_for_schema_cache_s(redis_client: redis.Redis,
                                                  settings: Settings) -> None:
    assert PayloadSchemas(redis_client, Settings(schema_cache_s=7)).cache_s == 7
    worker = PayloadSchemas(redis_client, settings, cache_s=0.5)
    bad = order({"order_id": "1"})
    assert worker.violations(bad) == []
    PayloadSchemas(redis_client, settings).register("order.close", 1, ORDER_SCHEMA)
    assert worker.violations(bad) == []  # read 0 s ago: not yet
    time.sleep(0.5)
    assert [(v.field, v.rule) for v in worker.violations(bad)] == [("payload.order_id",
                                                                    "schema")]
    worker.delete("order.close", 1)  # its own change is seen at once
    assert worker.violations(bad) == []


def test_a_schema_stored_by_hand_that_cannot_compile_is_ignored_and_logged(
        redis_client: redis.Redis, settings: Settings, schemas: PayloadSchemas,
        caplog: pytest.LogCaptureFixture) -> None:
    key = settings.keys.schemas
    redis_client.hset(key, mapping={
        "order.close@1": "{not json", "order.close@2": json.dumps({"type": 12}),
        "order.close@3": json.dumps({"$ref": "#/$defs/missing"}),
        "order.close@4": json.dumps(ORDER_SCHEMA)})
    with caplog.at_level(logging.WARNING, logger="kombu_envelope.store.schemas"):
        for version in (1, 2, 3):
            assert schemas.violations(order({"order_id": "x"}, version)) == []
        assert schemas.violations(order({"order_id": "x"}, 4))  # the good one still counts
    logged = caplog.text
    assert "order.close@1 is ignored" in logged and "order.close@2 is ignored" in logged
    assert "order.close@3 is ignored" in logged
    assert list(schemas.all()) == [("order.close", 2), ("order.close", 3), ("order.close", 4)]


# ----------------------------------------------------------------- publish


def test_publisher_refuses_a_payload_that_breaks_its_schema(
        redis_client: redis.Redis, settings: Settings, schemas: PayloadSchemas) -> None:
    schemas.register("order.close", 1, ORDER_SCHEMA)
    publisher = Publisher(redis_client, settings)
    bad = order({"lines": [{"quantity": 1}, {"quantity": 0}], "colour": "red"})
    with pytest.raises(InvalidEnvelope) as refused:
        publisher.publish(QUEUE, bad)
    assert [(v.field, v.rule) for v in refused.value.violations] == [
        ("payload.colour", "schema"), ("payload.lines[1].quantity", "schema"),
        ("payload.order_id", "schema")]
    assert "payload.order_id: 'order_id' is a required property [schema]" in str(refused.value)
    later = Envelope.new(task_type="order.close", payload={},
                         schedule_time=utcnow() + timedelta(minutes=1))
    good = order({"order_id": 7})
    with pytest.raises(InvalidEnvelope):
        publisher.publish_many([(QUEUE, good), (QUEUE, later)])
    assert stored_tasks(redis_client, settings) == 0
    assert publisher.publish(QUEUE, good) is not None
    assert publisher.publish(QUEUE, order({"anything": "goes"}, version=2)) is not None
    assert stored_tasks(redis_client, settings) == 2


def test_dlq_replay_refuses_an_edit_that_breaks_the_schema(
        redis_client: redis.Redis, settings: Settings, schemas: PayloadSchemas) -> None:
    envelope = order({"order_id": "7"})
    dead_id = dead_letter_envelope(
        redis_client, settings, queue=QUEUE, envelope=envelope, consumer="test",
        failure=Failure(FailureClass.INVALID_PAYLOAD, "schema: payload.order_id: wrong"))
    schemas.register("order.close", 1, ORDER_SCHEMA)
    dead = DeadLetters(redis_client, settings)
    with pytest.raises(InvalidEnvelope, match=r"payload\.order_id"):
        dead.replay(QUEUE, dead_id, ReplayEdit(merge_patch={"order_id": "8"}))
    assert stored_tasks(redis_client, settings) == 0
    assert dead.replay(QUEUE, dead_id, ReplayEdit(merge_patch={"order_id": 8})) is not None


# ------------------------------------------------------------------ celery


@pytest.fixture(scope="module")
def celery_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix whose envelope_app.add@1 schema wants two integers."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(redis_url)
    PayloadSchemas(client, Settings(key_prefix=prefix)).register("envelope_app.add", 1, {
        "type": "object", "required": ["x", "y"], "additionalProperties": False,
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}})
    client.close()
    yield prefix


@pytest.fixture(scope="module")
def celery_app(redis_url: str, celery_prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, celery_prefix, 1500)
    yield app
    app.close()


def test_apply_async_refuses_a_payload_that_breaks_its_schema(
        celery_app: Celery, redis_client: redis.Redis, celery_prefix: str) -> None:
    add = celery_app.tasks["envelope_app.add"]
    with pytest.raises(InvalidEnvelope) as refused:
        add.apply_async((1, "2"), queue="refused")
    assert refused.value.fields == ["payload.y"]
    assert refused.value.rules == ["schema"]
    settings = Settings(key_prefix=celery_prefix)
    assert stored_tasks(redis_client, settings, "refused") == 0


def test_a_worker_dead_letters_a_payload_that_breaks_its_schema(
        redis_url: str, celery_app: Celery, redis_client: redis.Redis,
        celery_prefix: str) -> None:
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": celery_prefix, "TEST_LEASE_MS": "1500"}
    task_id = str(uuid.uuid4())
    body = {"task_id": task_id, "task_type": "envelope_app.add", "payload": {"x": 1, "z": 2},
            "trace_id": "go-1", "created_at": "2025-09-11T12:45:00+08:00",
            "ext": {"celery": {"result": {"key": f"celery-task-meta-{task_id}",
                                          "expires_s": 60}}}}
    # Written as another language's producer that does not check schemas would.
    redis_client.xadd(KeySpace(celery_prefix).queue("celery").stream(Bucket.NORMAL),
                      {"v": "1", "enc": "json", "body": json.dumps(body)})
    with CeleryWorker("apps.envelope_app", pool="solo", env=env) as worker:
        dead = wait_for(lambda: [f for f in dead_letters(redis_client, celery_prefix, "celery")
                                 if f.get("task_id") == task_id.encode()],
                        message=worker.log_tail)[0]
        assert dead["failure_class"] == b"invalid_payload"
        assert dead["reason"].decode() == (
            "schema: payload.y: 'y' is a required property; "
            "payload.z: Additional properties are not allowed ('z' was unexpected)")
        assert json.loads(dead["raw.body"]) == body  # the entry's own bytes
        with pytest.raises(Exception) as failed:
            AsyncResult(task_id, app=celery_app).get(timeout=20)
        assert type(failed.value).__name__ == "invalid_payload"
        assert celery_app.tasks["envelope_app.add"].delay(1, 2).get(timeout=20) == 3
        assert "envelope_app.add[" + task_id not in worker.log_text()  # never run


# --------------------------------------------------------------------- cli


def test_schema_commands(redis_client: redis.Redis, settings: Settings,
                         tmp_path: Path) -> None:
    commands = schema_commands(lambda ctx: PayloadSchemas(redis_client, settings))
    runner = CliRunner()
    schema_file = tmp_path / "order.json"
    schema_file.write_text(json.dumps(ORDER_SCHEMA))
    done = runner.invoke(commands, ["register", "order.close", "1", str(schema_file)])
    assert (done.exit_code, done.output) == (0, "registered the schema of order.close@1\n")
    done = runner.invoke(commands, ["register", "order.close", "2", "-"], input="{}")
    assert done.exit_code == 0, done.output
    listed = runner.invoke(commands, ["list"])
    assert [line.split(None, 2) for line in listed.output.splitlines()[2:]] == [
        ["order.close", "1", "close an order"], ["order.close", "2"]]
    listed = runner.invoke(commands, ["list", "--json"])
    assert json.loads(listed.output)[0] == {"task_type": "order.close", "payload_version": 1,
                                            "schema": ORDER_SCHEMA}
    shown = runner.invoke(commands, ["show", "order.close", "1"])
    assert json.loads(shown.output) == ORDER_SCHEMA
    assert runner.invoke(commands, ["delete", "order.close", "2"]).exit_code == 0
    for args, error in [
        (["show", "order.close", "2"], "no schema for order.close@2"),
        (["delete", "order.close", "2"], "no schema for order.close@2"),
        (["show", "order close", "1"], "task_type 'order close' does not match"),
        (["register", "order.close", "3", "-"], "<stdin> is not JSON"),
    ]:
        failed = runner.invoke(commands, args, input="{not json")
        assert failed.exit_code == 1 and error in failed.output, (args, failed.output)
    failed = runner.invoke(commands, ["register", "order.close", "3", "-"],
                           input='{"type": "objectx"}')
    assert failed.exit_code == 1
    assert "order.close@3: not a valid draft 2020-12 schema: at #/type: 'objectx'" in failed.output
    assert list(PayloadSchemas(redis_client, settings).all()) == [("order.close", 1)]


def test_celery_and_standalone_command_lines(redis_url: str, key_prefix: str,
                                             redis_client: redis.Redis) -> None:
    env = {**os.environ, "TEST_BROKER_URL": envelope_url(redis_url),
           "TEST_RESULT_BACKEND": redis_url, "TEST_KEY_PREFIX": key_prefix,
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)])}
    celery = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.reliable_app", "envelope", "schemas",
         "register", "order.close", "1", "-"], input=json.dumps(ORDER_SCHEMA),
        capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)
    assert celery.returncode == 0, celery.stderr
    standalone = subprocess.run(
        [sys.executable, "-m", "kombu_envelope.schemas_cli", "--url", redis_url,
         "--key-prefix", key_prefix, "list", "--json"],
        capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)
    assert standalone.returncode == 0, standalone.stderr
    assert json.loads(standalone.stdout) == [{"task_type": "order.close", "payload_version": 1,
                                              "schema": ORDER_SCHEMA}]
