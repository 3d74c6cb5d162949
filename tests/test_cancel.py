"""Cancelling and expiring tasks: DelayedTasks.cancel, Celery's revoke, ``expires``.

Real ``celery worker`` processes (apps/envelope_app.py) run the tasks;
``envelope_app.flaky(key, 0)`` counts its runs in Redis, the effect that a
cancelled or expired task must never have.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import closing
from datetime import timedelta

import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery
from celery.result import AsyncResult
from support import wait_for
from support.envelope_streams import connect, envelope_url, pending_count
from support.workers import CeleryWorker

from celery_ext.revoke import revoked_task_ids
from kombu_envelope.delayed import Cancellation, CancelOutcome, DelayedTasks
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.keys import QueueKeys
from kombu_envelope.publisher import Publisher
from kombu_envelope.scheduler import Promoter
from kombu_envelope.settings import Settings

APP = "apps.envelope_app"
RESULT_TIMEOUT = 20
NOT_RUN_LOG = r"task (\S+) \(envelope_app\.flaky\) was {why}; delivered to be recorded"
CANCELLED_LOG = re.compile(NOT_RUN_LOG.format(why="revoked"))
EXPIRED_LOG = re.compile(NOT_RUN_LOG.format(why="expired"))


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
    assert redis_client.zscore(settings.keys.cancelled, task.id) is not None

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
    assert AsyncResult(task.id, app=app).state == "REVOKED"
    # The mark stays: the same id published again within 7 days does not run either.
    assert redis_client.zscore(settings.keys.cancelled, task.id) is not None


def test_cancelling_twice_and_unknown_ids(
    app: Celery, redis_client: redis.Redis, keys: QueueKeys, delayed: DelayedTasks,
) -> None:
    task = app.tasks["envelope_app.flaky"].apply_async(("twice", 0), countdown=3600)
    assert delayed.cancel(task.id, "celery") is CancelOutcome.REMOVED
    # Removed and marked at once: the mark is written first and always.
    assert delayed.cancel(task.id, "celery") is CancelOutcome.ALREADY

    assert delayed.cancel("no-such-task", "celery") is CancelOutcome.MARKED
    assert delayed.cancel("no-such-task", "celery") is CancelOutcome.ALREADY
    assert redis_client.zcard(keys.delayed) == 0
    assert redis_client.zcard(delayed.settings.keys.cancelled) == 2


def test_old_marks_are_dropped_when_a_task_is_cancelled(
    redis_client: redis.Redis, delayed: DelayedTasks,
) -> None:
    cancelled = delayed.settings.keys.cancelled
    now_ms = int(utcnow().timestamp() * 1000)
    redis_client.zadd(cancelled, {"eight-days-ago": now_ms - 8 * 24 * 3600 * 1000,
                                  "six-days-ago": now_ms - 6 * 24 * 3600 * 1000})
    assert delayed.cancel_everywhere("now") == Cancellation(CancelOutcome.MARKED)
    assert sorted(m.decode() for m in redis_client.zrange(cancelled, 0, -1)) == [
        "now", "six-days-ago"]


def test_cancel_everywhere_finds_the_queue(app: Celery, delayed: DelayedTasks) -> None:
    flaky = app.tasks["envelope_app.flaky"]
    flaky.apply_async(("a", 0), countdown=3600, queue="first")
    task = flaky.apply_async(("b", 0), countdown=3600, queue="second")
    assert delayed.cancel_everywhere(task.id) == Cancellation(CancelOutcome.REMOVED, "second")
    assert delayed.cancel_everywhere(task.id) == Cancellation(CancelOutcome.ALREADY)
    assert delayed.counts() == {"first": 1, "second": 0}


def test_revoke_reaches_a_worker_started_later_on_a_queue_that_never_delayed_a_task(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    delayed: DelayedTasks,
) -> None:
    """The broadcast is gone before the worker starts; the mark in Redis is not."""
    flaky = app.tasks["envelope_app.flaky"]
    queued = flaky.delay("queued", 0)
    later = flaky.apply_async(("later", 0), countdown=3600)
    assert delayed.queues() == ["celery"]
    fresh = settings.keys.queue("fresh")
    elsewhere = flaky.apply_async(("elsewhere", 0), queue="fresh")
    assert redis_client.sismember(settings.keys.queues, "fresh") == 0  # never delayed a task
    for result in (queued, later, elsewhere):
        AsyncResult(result.id, app=app).revoke()
    assert redis_client.zscore(settings.keys.queue("celery").delayed, later.id) is None

    with worker(redis_url, key_prefix) as started:
        control = flaky.delay("control", 0)
        assert control.get(timeout=RESULT_TIMEOUT) == 1
        wait_for(lambda: {queued.id} <= {m.group(1) for m in
                                          CANCELLED_LOG.finditer(started.log_text())},
                 message=started.log_tail)
    assert AsyncResult(queued.id, app=app).state == "REVOKED"
    assert runs(redis_client, key_prefix, "queued") == 0
    assert runs(redis_client, key_prefix, "later") == 0

    # A plain kombu consumer of the other queue acknowledges it without delivering it.
    with connect(redis_url, key_prefix) as connection, \
            closing(connection.SimpleQueue("fresh")) as queue, pytest.raises(queue.Empty):
        queue.get(timeout=1)
    assert stream_len(redis_client, fresh) == 0
    assert runs(redis_client, key_prefix, "elsewhere") == 0


def test_an_expired_celery_task_is_revoked_without_running(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    flaky = app.tasks["envelope_app.flaky"]
    expired = flaky.apply_async(("expired", 0), expires=utcnow() - timedelta(seconds=1))
    # Written without Celery: no ext.celery, only the Envelope field.
    raw = Envelope.new(task_type="envelope_app.flaky", payload={"key": "raw", "failures": 0},
                       expires=utcnow() - timedelta(seconds=1))
    Publisher(redis_client, settings).publish("celery", raw)
    with worker(redis_url, key_prefix) as started:
        assert flaky.delay("control", 0).get(timeout=RESULT_TIMEOUT) == 1
        wait_for(lambda: {expired.id, raw.task_id} <= {
            m.group(1) for m in EXPIRED_LOG.finditer(started.log_text())},
            message=started.log_tail)
        wait_for(lambda: AsyncResult(raw.task_id, app=app).state == "REVOKED",
                 message=started.log_tail)
    assert AsyncResult(expired.id, app=app).state == "REVOKED"
    assert runs(redis_client, key_prefix, "expired") == 0
    assert runs(redis_client, key_prefix, "raw") == 0
    assert stream_len(redis_client, keys) == 0


def test_a_plain_kombu_consumer_acknowledges_an_expired_task_without_delivering_it(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
) -> None:
    publisher = Publisher(redis_client, settings)
    publisher.publish("plain", Envelope.new(task_type="orders.close",
                                            expires=utcnow() - timedelta(seconds=1)))
    alive = Envelope.new(task_type="orders.close", expires=utcnow() + timedelta(hours=1))
    publisher.publish("plain", alive)
    with connect(redis_url, key_prefix) as connection, \
            closing(connection.SimpleQueue("plain")) as queue:
        message = queue.get(timeout=5)
        assert message.payload["task_id"] == alive.task_id
        message.ack()
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
    assert stream_len(redis_client, settings.keys.queue("plain")) == 0


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
