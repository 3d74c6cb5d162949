"""Delayed Celery tasks (countdown, eta) with real ``celery worker`` processes.

Two solo workers of apps/envelope_app.py share one key prefix, with a 1 s
consumer lease. Delayed tasks wait in Redis, not in worker memory, so a delay
longer than the lease never makes another worker run the task again, and a
million-task backlog costs the workers nothing. Lateness is bounded loosely.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import psutil
import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from kombu_envelope.codec import decode_body
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.keys import KeySpace, QueueKeys

APP = "apps.envelope_app"
LEASE_MS = 1000
RESULT_TIMEOUT = 20


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def keys(prefix: str) -> QueueKeys:
    return KeySpace(prefix).queue("celery")


@pytest.fixture(scope="module")
def workers(redis_url: str, prefix: str) -> Iterator[list[CeleryWorker]]:
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(LEASE_MS)}
    started = [CeleryWorker(APP, env=env) for _ in range(2)]
    try:
        for worker in started:
            worker.start(wait_ready=False)
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(CeleryWorker.close, started))


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix, LEASE_MS)
    yield app
    app.close()


def stream_len(client: redis.Redis, keys: QueueKeys) -> int:
    return sum(client.xlen(stream) for stream in keys.task_streams)


def runs(client: redis.Redis, prefix: str, key: str) -> int:
    """How many times ``envelope_app.flaky(key, ...)`` ran."""
    return int(client.get(f"{prefix}:flaky:{key}") or 0)


def test_a_countdown_longer_than_the_lease_runs_once(
    app: Celery, workers: list[CeleryWorker], redis_client: redis.Redis, prefix: str,
    keys: QueueKeys,
) -> None:
    key = uuid.uuid4().hex
    published = datetime.now(timezone.utc)
    result = app.tasks["envelope_app.flaky"].apply_async((key, 0), countdown=3)
    assert redis_client.zscore(keys.delayed, result.id) is not None
    assert result.get(timeout=RESULT_TIMEOUT) == 1
    assert result.date_done >= published + timedelta(seconds=2.95)
    # Two more leases go by: nobody takes the task over and runs it again.
    deadline = time.monotonic() + 2.5 * LEASE_MS / 1000
    while time.monotonic() < deadline:
        assert runs(redis_client, prefix, key) == 1
        time.sleep(0.05)
    assert stream_len(redis_client, keys) == 0
    assert redis_client.zcard(keys.delayed) == 0


def test_ten_thousand_delayed_tasks_stay_in_redis_not_in_workers(
    app: Celery, workers: list[CeleryWorker], redis_client: redis.Redis, keys: QueueKeys,
) -> None:
    processes = [psutil.Process(worker.pid) for worker in workers]
    before = [process.memory_info().rss for process in processes]
    add = app.tasks["envelope_app.add"]

    def publish(start: int) -> None:
        with app.producer_or_acquire() as producer:
            for n in range(start, start + 2500):
                add.apply_async((n, n), countdown=3600, producer=producer, ignore_result=True)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(publish, range(0, 10_000, 2500)))
    try:
        assert redis_client.zcard(keys.delayed) == 10_000
        # The promoters were woken by the first publish, looked at them and left them.
        for _ in range(20):
            assert stream_len(redis_client, keys) == 0
            time.sleep(0.1)
        assert all(worker.is_alive() for worker in workers)
        after = [process.memory_info().rss for process in processes]
        growth_mb = [(a - b) / 2**20 for a, b in zip(after, before)]
        assert all(growth < 20 for growth in growth_mb), f"worker RSS grew by {growth_mb} MB"
        assert redis_client.zcard(keys.delayed) == 10_000
        assert stream_len(redis_client, keys) == 0
    finally:
        redis_client.delete(keys.delayed, keys.delayed_data)


def test_a_past_eta_runs_at_once(
    app: Celery, workers: list[CeleryWorker], redis_client: redis.Redis, keys: QueueKeys,
) -> None:
    an_hour_ago = datetime.now(timezone.utc) - timedelta(hours=1)
    result = app.tasks["envelope_app.add"].apply_async((2, 3), eta=an_hour_ago)
    assert redis_client.zscore(keys.delayed, result.id) is None  # straight to the stream
    assert result.get(timeout=RESULT_TIMEOUT) == 5


@pytest.mark.parametrize("when", ["countdown", "eta"])
def test_more_than_90_days_ahead_is_refused_at_apply_async(
    app: Celery, redis_client: redis.Redis, prefix: str, when: str,
) -> None:
    too_far: dict[str, Any] = {
        "countdown": {"countdown": 91 * 24 * 3600},
        "eta": {"eta": datetime.now(timezone.utc) + timedelta(days=91)},
    }[when]
    with pytest.raises(InvalidEnvelope, match=r"more than 90 days.*maximum delay") as caught:
        app.tasks["envelope_app.add"].apply_async((1, 2), queue="far", **too_far)
    assert caught.value.fields == ["schedule_time"]
    assert caught.value.rules == ["max_delay"]
    far = KeySpace(prefix).queue("far")
    assert redis_client.zcard(far.delayed) == 0
    assert stream_len(redis_client, far) == 0


def test_an_eta_with_an_offset_runs_at_that_instant(
    app: Celery, workers: list[CeleryWorker], redis_client: redis.Redis, keys: QueueKeys,
) -> None:
    beijing = timezone(timedelta(hours=8))
    eta = datetime.now(beijing).replace(microsecond=0) + timedelta(seconds=3)
    result = app.tasks["envelope_app.add"].apply_async((4, 4), eta=eta)
    assert redis_client.zscore(keys.delayed, result.id) == eta.timestamp() * 1000
    _bucket, enc, body = redis_client.hget(keys.delayed_data, result.id).split(b"\n", 2)
    assert decode_body(enc, body).schedule_time.utcoffset() == timedelta(hours=8)
    assert result.get(timeout=RESULT_TIMEOUT) == 8
    ran_at = result.date_done
    assert eta - timedelta(milliseconds=50) <= ran_at <= eta + timedelta(seconds=5)
