"""A retry replaces the pending entry of its task atomically (retry.lua), with real workers.

With ``acks_late``, or the solo pool (which acknowledges after the task), the
entry of a running task is pending until the task ends. Its retry must not be
published beside it: ``reliable.retry_then_die`` retries and its process dies
at once, before anything is acknowledged, and still the stream holds nothing
and the delayed set the one next attempt.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from apps.reliable_app import create_app
from celery import Celery
from support import wait_for
from support.envelope_streams import envelope_url, pending_count
from support.workers import CeleryWorker

from kombu_envelope.codec import decode_body
from kombu_envelope.envelope import Envelope, format_rfc3339, utcnow
from kombu_envelope.keys import Bucket, QueueKeys
from kombu_envelope.scripts import script
from kombu_envelope.settings import Settings

APP = "apps.reliable_app"
TAKEN_OVER_LOG = "is no longer pending (taken over); its new owner runs it"


def worker_env(redis_url: str, prefix: str, acks_late: bool) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": "5000",
            "TEST_ACKS_LATE": "1" if acks_late else "0"}


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def keys(settings: Settings) -> QueueKeys:
    return settings.keys.queue("celery")


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, 5000)
    yield app
    app.close()


def in_streams(client: redis.Redis, keys: QueueKeys, group: str) -> tuple[int, int]:
    """(entries, pending entries) in the task streams of a queue."""
    return (sum(client.xlen(stream) for stream in keys.task_streams),
            sum(pending_count(client, stream, group) for stream in keys.task_streams))


def delayed_envelope(client: redis.Redis, keys: QueueKeys, task_id: str) -> Envelope:
    stored = client.hget(keys.delayed_data, task_id)
    assert stored is not None
    _bucket, enc, body = stored.split(b"\n", 2)
    return decode_body(enc, body)


@pytest.mark.parametrize(("pool", "acks_late"), [("prefork", True), ("solo", True),
                                                  ("solo", False)],
                         ids=["prefork-acks-late", "solo-acks-late", "solo-early-acks"])
def test_a_retry_replaces_its_pending_entry_even_when_the_worker_dies_at_once(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str,
    settings: Settings, keys: QueueKeys, pool: str, acks_late: bool,
) -> None:
    with CeleryWorker(APP, pool=pool, concurrency=1,
                      env=worker_env(redis_url, key_prefix, acks_late)) as worker:
        before = utcnow()
        task = app.tasks["reliable.retry_then_die"].delay(f"die-{uuid.uuid4().hex[:6]}")
        wait_for(lambda: redis_client.zscore(keys.delayed, task.id) is not None,
                 message=worker.log_tail)
        # Whatever the pool does about its lost process, nothing of the task is left
        # in the streams: no second copy, no pending entry to take over and run again.
        wait_for(lambda: in_streams(redis_client, keys, settings.consumer_group) == (0, 0),
                 timeout=5, message=worker.log_tail)
        retried = delayed_envelope(redis_client, keys, task.id)
    assert retried.retry_count == 1
    assert retried.schedule_time is not None
    assert before + timedelta(minutes=59) < retried.schedule_time < utcnow() + timedelta(hours=1)
    assert retried.headers.get("x-first-failure-at")
    assert redis_client.zcard(keys.delayed) == 1
    assert in_streams(redis_client, keys, settings.consumer_group) == (0, 0)


def test_a_retry_whose_entry_was_taken_over_publishes_nothing(
    app: Celery, redis_url: str, redis_client: redis.Redis, key_prefix: str,
    settings: Settings, keys: QueueKeys,
) -> None:
    name = f"held-{uuid.uuid4().hex[:6]}"
    hold = f"{key_prefix}:probe:hold:{name}"
    redis_client.set(hold, 1)
    parked = settings.keys.queue("parked")
    with CeleryWorker(APP, pool="prefork", concurrency=1,
                      env=worker_env(redis_url, key_prefix, acks_late=True)) as worker:
        task = app.tasks["reliable.retry_after_hold"].delay(name)
        wait_for(lambda: redis_client.exists(f"{key_prefix}:probe:holding:{name}"),
                 message=worker.log_tail)
        stream = keys.stream(Bucket.NORMAL)
        (entry,) = redis_client.xpending_range(stream, settings.consumer_group, "-", "+", 10)
        # Taken over, as when its consumer looked dead: another consumer owns it now.
        moved = script(redis_client, "requeue")(
            keys=[stream, parked.stream(Bucket.NORMAL), keys.dead],
            args=[settings.consumer_group, entry["message_id"], "", 0, 0, 0,
                  format_rfc3339(utcnow())])
        assert moved
        redis_client.delete(hold)
        worker.wait_for_log(TAKEN_OVER_LOG)
        wait_for(lambda: task.state == "RETRY", message=worker.log_tail)
    assert redis_client.zcard(keys.delayed) == 0
    assert in_streams(redis_client, keys, settings.consumer_group) == (0, 0)
    assert redis_client.xlen(parked.stream(Bucket.NORMAL)) == 1  # its new owner's copy
