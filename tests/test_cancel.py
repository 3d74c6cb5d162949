"""Cancelling tasks: DelayedTasks.cancel, and Celery's revoke for delayed tasks.

Real ``celery worker`` processes (apps/envelope_app.py) run the tasks;
``envelope_app.flaky(key, 0)`` counts its runs in Redis, the effect that a
cancelled task must never have.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery
from celery.result import AsyncResult
from support import wait_for
from support.envelope_streams import envelope_url, pending_count
from support.workers import CeleryWorker

from celery_ext.revoke import revoked_task_ids
from kombu_envelope.delayed import CancelOutcome, DelayedTasks
from kombu_envelope.keys import QueueKeys
from kombu_envelope.scheduler import Promoter
from kombu_envelope.settings import Settings

APP = "apps.envelope_app"
RESULT_TIMEOUT = 20
CANCELLED_LOG = re.compile(r"task (\S+) \(envelope_app\.flaky\) was cancelled; acknowledged")


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def keys(settings: Settings) -> QueueKeys:
    return settings.keys.queue("celery")


@pytest.fixture
def delayed(redis_client: redis.Redis, settings: Settings) -> DelayedTasks:
    return DelayedTasks(redis_client, settings)


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix)
    yield app
    app.close()


def worker(redis_url: str, key_prefix: str) -> CeleryWorker:
    return CeleryWorker(APP, env={"TEST_BROKER_URL": envelope_url(redis_url),
                                  "TEST_RESULT_BACKEND": redis_url,
                                  "TEST_KEY_PREFIX": key_prefix})


def runs(client: redis.Redis, key_prefix: str, key: str) -> int:
    """How many times ``envelope_app.flaky(key, ...)`` ran."""
    return int(client.get(f"{key_prefix}:flaky:{key}") or 0)


def stream_len(client: redis.Redis, keys: QueueKeys) -> int:
    return sum(client.xlen(stream) for stream in keys.task_streams)


def test_cancelled_before_promotion_a_task_never_runs(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
    delayed: DelayedTasks,
) -> None:
    flaky = app.tasks["envelope_app.flaky"]
    with worker(redis_url, key_prefix):
        cancelled = flaky.apply_async(("cancelled", 0), countdown=1)
        revoked = flaky.apply_async(("revoked", 0), countdown=1)
        control = flaky.apply_async(("control", 0), countdown=1.5)
        assert delayed.cancel(cancelled.id, "celery") is CancelOutcome.REMOVED
        revoked.revoke()
        # Gone from Redis as soon as revoke() returns, whatever the workers do.
        assert redis_client.zscore(keys.delayed, revoked.id) is None
        assert redis_client.hexists(keys.delayed_data, revoked.id) == 0
        assert control.get(timeout=RESULT_TIMEOUT) == 1  # promoted after the others' due time
    assert runs(redis_client, key_prefix, "cancelled") == 0
    assert runs(redis_client, key_prefix, "revoked") == 0
    assert redis_client.zcard(keys.delayed) == 0
    assert stream_len(redis_client, keys) == 0


def test_revoke_cancels_a_delayed_task_while_no_worker_runs(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    """Celery's own revoke lives in worker memory: a worker started later never heard of it."""
    flaky = app.tasks["envelope_app.flaky"]
    revoked = flaky.apply_async(("revoked", 0), countdown=0.5)
    kept = flaky.apply_async(("kept", 0), countdown=0.5)
    AsyncResult(revoked.id, app=app).revoke()
    assert redis_client.zscore(keys.delayed, revoked.id) is None
    assert redis_client.zscore(keys.delayed, kept.id) is not None
    # A revoke sent to chosen workers only is a message to those workers.
    app.control.revoke(kept.id, destination=["someone@elsewhere"])
    assert redis_client.zscore(keys.delayed, kept.id) is not None
    with worker(redis_url, key_prefix):
        assert kept.get(timeout=RESULT_TIMEOUT) == 1
    assert runs(redis_client, key_prefix, "revoked") == 0
    assert stream_len(redis_client, keys) == 0


def test_cancelled_after_promotion_a_later_worker_acks_it_without_running_it(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys, delayed: DelayedTasks,
) -> None:
    flaky = app.tasks["envelope_app.flaky"]
    task = flaky.apply_async(("promoted", 0), countdown=0.2)
    promoter = Promoter(lambda: redis_client, settings)
    wait_for(lambda: promoter.run_once()[0] == 1, timeout=5)  # no worker: it waits in the stream
    assert stream_len(redis_client, keys) == 1
    assert delayed.cancel(task.id, "celery") is CancelOutcome.MARKED
    assert redis_client.zscore(keys.cancelled, task.id) is not None

    with worker(redis_url, key_prefix) as started:
        control = flaky.delay("control", 0)
        assert control.get(timeout=RESULT_TIMEOUT) == 1
        wait_for(lambda: any(m.group(1) == task.id
                             for m in CANCELLED_LOG.finditer(started.log_text())),
                 message=started.log_tail)
    assert runs(redis_client, key_prefix, "promoted") == 0
    assert stream_len(redis_client, keys) == 0
    assert all(pending_count(redis_client, stream, settings.consumer_group) == 0
               for stream in keys.task_streams)
    assert redis_client.zscore(keys.cancelled, task.id) is None  # the mark was used up


def test_cancelling_twice_and_unknown_ids(
    app: Celery, redis_client: redis.Redis, keys: QueueKeys, delayed: DelayedTasks,
) -> None:
    task = app.tasks["envelope_app.flaky"].apply_async(("twice", 0), countdown=3600)
    assert delayed.cancel(task.id, "celery") is CancelOutcome.REMOVED
    # Not delayed any more: from now on it can only be marked (in case it is in a stream).
    assert delayed.cancel(task.id, "celery") is CancelOutcome.MARKED
    assert delayed.cancel(task.id, "celery") is CancelOutcome.ALREADY

    assert delayed.cancel("no-such-task", "celery") is CancelOutcome.MARKED
    assert delayed.cancel("no-such-task", "celery") is CancelOutcome.ALREADY
    assert redis_client.zcard(keys.delayed) == 0


def test_cancel_everywhere_finds_the_queue(app: Celery, delayed: DelayedTasks) -> None:
    flaky = app.tasks["envelope_app.flaky"]
    flaky.apply_async(("a", 0), countdown=3600, queue="first")
    task = flaky.apply_async(("b", 0), countdown=3600, queue="second")
    assert delayed.cancel_everywhere(task.id) == {"second": CancelOutcome.REMOVED}
    assert delayed.cancel_everywhere(task.id) == {"first": CancelOutcome.MARKED,
                                                  "second": CancelOutcome.MARKED}
    assert delayed.counts() == {"first": 1, "second": 0}


@pytest.mark.parametrize(("exchange", "body", "expected"), [
    ("celery.pidbox", '{"method": "revoke", "arguments": {"task_id": "a"}}', ["a"]),
    ("celery.pidbox", '{"method": "revoke", "arguments": {"task_id": ["a", "b"]},'
                      ' "destination": null}', ["a", "b"]),
    ("celery.pidbox", '{"method": "revoke", "arguments": {"task_id": "a"},'
                      ' "destination": ["w1@host"]}', []),
    ("celery.pidbox", '{"method": "ping", "arguments": {}}', []),
    ("celery.pidbox", "not json", []),
    ("celery", '{"method": "revoke", "arguments": {"task_id": "a"}}', []),
])
def test_revoke_broadcasts_are_recognised(exchange: str, body: str, expected: list[str]) -> None:
    message = {"body": body, "content-type": "application/json", "content-encoding": "utf-8",
               "headers": {}, "properties": {}}
    assert revoked_task_ids(exchange, message) == expected
