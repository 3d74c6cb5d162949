"""Terminal failures land in the dead-letter stream; replays run them again, once."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from apps.reliable_app import create_app
from celery import Celery
from celery.exceptions import Reject
from celery.result import AsyncResult
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from celery_ext.failures import REBUILT_NOTE, InvalidPayload
from kombu_envelope.envelope import Envelope
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket, KeySpace
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import (
    DeadLetter,
    DeadLetters,
    ReplayEdit,
    dead_letter_envelope,
)

APP = "apps.reliable_app"
RESULT_TIMEOUT = 30
QUEUE = "celery"


def worker_env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": "5000", **extra}


def dead_letter_of(client: redis.Redis, prefix: str, task_id: str,
                   worker: CeleryWorker) -> DeadLetter:
    dead = DeadLetters(client, Settings(key_prefix=prefix))
    return wait_for(lambda: next((e for e in dead.iter(QUEUE) if e.task_id == task_id), None),
                    message=worker.log_tail)


def xadd(client: redis.Redis, prefix: str, fields: dict[str, Any]) -> None:
    client.xadd(KeySpace(prefix).queue(QUEUE).stream(Bucket.NORMAL), fields)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    """A solo worker (the shell enforces time limits itself) acknowledging late."""
    with CeleryWorker(APP, pool="solo", env=worker_env(redis_url, prefix)) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix, 5000)
    yield app
    app.close()


def _unique(text: str) -> str:
    return f"{text}-{uuid.uuid4().hex[:6]}"


# Each case publishes a task and returns (task_id, exception the result raises or None).
def _transient(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    result = app.tasks["reliable.flaky"].apply_async((_unique("flaky"), 99), retries=4)
    return result.id, ConnectionError


def _task_error(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    return app.tasks["reliable.broken"].delay(_unique("broken")).id, ValueError


def _invalid(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    return app.tasks["reliable.invalid"].delay(_unique("invalid")).id, InvalidPayload


def _timeout(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    result = app.tasks["reliable.slow"].apply_async((_unique("slow"), 60), soft_time_limit=0.3)
    return result.id, Exception


def _rejected(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    return app.tasks["reliable.rejecting"].delay(_unique("reject")).id, Reject


def _unsupported(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    result = app.tasks["reliable.versioned"].apply_async((1,), headers={"payload_version": 3})
    return result.id, None


def _unknown(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    envelope = Envelope.new(task_type="nobody.knows", payload={"a": 1})
    xadd(client, prefix, {"v": "1", "enc": "json", "body": envelope.to_json()})
    return envelope.task_id, None


def _malformed(app: Celery, client: redis.Redis, prefix: str) -> tuple[str, Any]:
    probe = uuid.uuid4().hex
    xadd(client, prefix, {"v": "1", "enc": "json", "body": b"{not json", "probe": probe})
    return probe, None


Case = Callable[[Celery, redis.Redis, str], tuple[str, Any]]


CASES = [
    (_transient, "transient_exhausted", "gave up after 6 attempts; last ConnectionError"),
    (_task_error, "task_error", "gave up after 2 attempts; last ValueError: broken"),
    (_invalid, "invalid_payload", "invalid payload: invalid-"),
    (_timeout, "timeout", "gave up after 2 attempts; last SoftTimeLimitExceeded"),
    (_rejected, "rejected", "rejected by the task: reject-"),
    (_unsupported, "unsupported_payload_version", "accepts payload versions [1, 2], not 3"),
    (_unknown, "unknown_task_type", "no task named 'nobody.knows'"),
    (_malformed, "malformed_entry", "Invalid JSON"),
]


@pytest.mark.parametrize(("publish", "failure_class", "reason"), CASES,
                         ids=[case[1] for case in CASES])
def test_each_failure_class_lands_in_the_dead_letter_stream(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str,
        publish: Case, failure_class: str, reason: str) -> None:
    task_id, raises = publish(app, redis_client, prefix)
    if failure_class == "malformed_entry":
        dead = DeadLetters(redis_client, Settings(key_prefix=prefix))
        entry = wait_for(lambda: next((e for e in dead.iter(QUEUE)
                                       if e.raw.get("probe") == task_id.encode()), None),
                         message=worker.log_tail)
        assert entry.raw["body"] == b"{not json"
    else:
        entry = dead_letter_of(redis_client, prefix, task_id, worker)
        assert entry.envelope is not None and entry.envelope.task_id == task_id
    assert entry.failure_class == failure_class
    assert reason in entry.fields["reason"]
    if raises is not None:  # the result backend has the failure too
        with pytest.raises(raises):
            AsyncResult(task_id, app=app).get(timeout=RESULT_TIMEOUT)
        fields = entry.fields
        assert fields["task_id"] == task_id and fields["traceback"].startswith("Traceback")
        assert fields["attempts"] == str(entry.envelope.retry_count + 1)
        assert {"language", "host", "pid", "consumer", "first_failure_at", "last_failure_at",
                "exception_type", "task_type", "dead_at"} <= set(fields)
    assert worker.is_alive()


def test_replay_with_an_edited_payload_and_a_new_version(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    result = app.tasks["reliable.versioned"].delay("ten")
    with pytest.raises(InvalidPayload):
        result.get(timeout=RESULT_TIMEOUT)
    entry = dead_letter_of(redis_client, prefix, result.id, worker)
    dead = DeadLetters(redis_client, Settings(key_prefix=prefix))
    edit = ReplayEdit(merge_patch={"amount": 10}, bump_version=True)
    assert dead.replay(QUEUE, entry.entry_id, edit) is not None
    probe = f"{prefix}:probe:versioned:{result.id}"
    assert wait_for(lambda: redis_client.get(probe), message=worker.log_tail) == b"2:10"
    assert dead.get(QUEUE, entry.entry_id) is None


def test_concurrent_replays_publish_once(redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    envelope = Envelope.new(task_type="reliable.versioned", payload={"amount": 1})
    dead_id = dead_letter_envelope(
        redis_client, settings, queue=QUEUE, envelope=envelope, consumer="test",
        failure=Failure(FailureClass.TASK_ERROR, "for the test", task_id=envelope.task_id))
    racers = 8
    barrier = threading.Barrier(racers)
    replies: list[str | None] = []

    def replay() -> None:
        client = redis.Redis(connection_pool=redis_client.connection_pool)
        barrier.wait()
        replies.append(DeadLetters(client, settings).replay(QUEUE, dead_id))

    threads = [threading.Thread(target=replay) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(replies) == racers
    assert len([reply for reply in replies if reply is not None]) == 1
    keys = settings.keys.queue(QUEUE)
    assert redis_client.xlen(keys.stream(Bucket.NORMAL)) == 1
    assert redis_client.xlen(keys.replayed) == 1
    assert redis_client.xlen(keys.dead) == 0


def test_without_acks_late_the_entry_is_rebuilt_from_the_request(
        redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, 5000)
    dead = DeadLetters(redis_client, Settings(key_prefix=key_prefix))
    try:
        env = worker_env(redis_url, key_prefix, TEST_ACKS_LATE="0")
        with CeleryWorker(APP, pool="prefork", env=env) as early:
            # The task fails once its entry has been acknowledged (at its start).
            result = app.tasks["reliable.invalid"].apply_async(
                ("early", 0.5), headers={"x-tenant": "acme"})
            with pytest.raises(InvalidPayload):
                result.get(timeout=RESULT_TIMEOUT)
            entry = dead_letter_of(redis_client, key_prefix, result.id, early)
            assert entry.failure_class == "invalid_payload"
            assert entry.fields["reason"].endswith(REBUILT_NOTE)
            assert entry.envelope is not None
            assert entry.envelope.task_type == "reliable.invalid"
            assert entry.envelope.payload == {"name": "early", "delay": 0.5}
            # reliable_app asks for the tiered policy: its producer says so in a header.
            assert entry.envelope.headers == {"x-tenant": "acme", "x-retry-policy": "tiered"}
            assert json.loads(entry.raw["body"])["task_id"] == result.id
            # It replays like any other entry: the task runs (and fails) again.
            assert dead.replay(QUEUE, entry.entry_id) is not None
            wait_for(lambda: [e for e in dead.iter(QUEUE) if e.task_id == result.id],
                     message=early.log_tail)
    finally:
        app.close()
