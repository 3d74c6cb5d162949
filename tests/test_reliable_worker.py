"""Real ``celery worker`` processes running plain tasks through the reliable-execution shell."""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis
from apps.reliable_app import create_app
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import AsyncResult
from prometheus_client import REGISTRY
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import CeleryWorker

from celery_ext import metrics
from celery_ext.time_limits import soft_time_limit
from kombu_envelope.envelope import Envelope, parse_rfc3339
from kombu_envelope.keys import Bucket
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher

APP = "apps.reliable_app"
RESULT_TIMEOUT = 30


def worker_env(redis_url: str, prefix: str, lease_ms: int = 5000,
               **extra: str) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(lease_ms), **extra}


def client_app(redis_url: str, prefix: str) -> Celery:
    return create_app(envelope_url(redis_url), redis_url, prefix, 5000)


def probe_key(prefix: str, *parts: Any) -> str:
    return ":".join([prefix, "probe", *map(str, parts)])


def attempts(client: redis.Redis, prefix: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in client.lrange(probe_key(prefix, "attempts", name), 0, -1)]


def gaps_of(seen: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive attempts."""
    return [later["at"] - earlier["at"] for earlier, later in pairwise(seen)]


def counter(client: redis.Redis, prefix: str, *parts: Any) -> int:
    return int(client.get(probe_key(prefix, *parts)) or 0)


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    """A prefork worker with four processes, shared by the tests of this module."""
    with CeleryWorker(APP, pool="prefork", concurrency=4,
                      env=worker_env(redis_url, prefix)) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = client_app(redis_url, prefix)
    yield app
    app.close()


# ------------------------------------------------------------------ idempotency


def test_a_duplicate_has_its_effect_once(app: Celery, worker: CeleryWorker,
                                         redis_client: redis.Redis, prefix: str) -> None:
    effect = app.tasks["reliable.effect"]
    assert effect.delay("o-1").get(timeout=RESULT_TIMEOUT) == 1
    duplicate = effect.delay("o-1")
    assert duplicate.get(timeout=RESULT_TIMEOUT) is None
    assert counter(redis_client, prefix, "effects", "o-1") == 1
    wait_for(lambda: f"{duplicate.id}] is a duplicate" in worker.log_text(),
             message=worker.log_tail)


def test_a_duplicate_waits_while_the_first_runs(app: Celery, worker: CeleryWorker,
                                                redis_client: redis.Redis, prefix: str) -> None:
    effect = app.tasks["reliable.effect"]
    redis_client.set(probe_key(prefix, "hold", "o-2"), 1)
    first = effect.delay("o-2", hold=True)
    wait_for(lambda: counter(redis_client, prefix, "started", "o-2"), message=worker.log_tail)
    second = effect.delay("o-2")
    wait_for(lambda: f"{second.id}] not run now: its idempotency key is held"
             in worker.log_text(), message=worker.log_tail)
    redis_client.delete(probe_key(prefix, "hold", "o-2"))
    assert first.get(timeout=RESULT_TIMEOUT) == 1
    assert second.get(timeout=RESULT_TIMEOUT) is None
    assert counter(redis_client, prefix, "effects", "o-2") == 1
    assert counter(redis_client, prefix, "started", "o-2") == 1


def test_two_entries_of_one_task_in_two_pool_processes_have_one_effect(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    """A failover that lost an ack or a promotion can leave two entries of one task; the
    prefork processes share the consumer, so the claim's holder names the entry."""
    effect = app.tasks["reliable.effect"]
    redis_client.set(probe_key(prefix, "hold", "o-3"), 1)
    first = effect.delay("o-3", hold=True)
    wait_for(lambda: counter(redis_client, prefix, "started", "o-3"), message=worker.log_tail)
    stream = Settings(key_prefix=prefix).keys.queue("celery").stream(Bucket.NORMAL)
    ((_, fields),) = [(entry_id, fields) for entry_id, fields in redis_client.xrange(stream)
                      if Envelope.parse(fields[b"body"]).task_id == first.id]
    redis_client.xadd(stream, fields)  # the same task again, as a second entry
    wait_for(lambda: f"{first.id}] not run now: its idempotency key is held"
             in worker.log_text(), message=worker.log_tail)
    redis_client.delete(probe_key(prefix, "hold", "o-3"))
    wait_for(lambda: f"{first.id}] is a duplicate" in worker.log_text(), timeout=RESULT_TIMEOUT,
             message=worker.log_tail)
    assert counter(redis_client, prefix, "effects", "o-3") == 1
    assert counter(redis_client, prefix, "started", "o-3") == 1


def test_redelivered_after_a_kill_has_its_effect_once(redis_url: str, key_prefix: str,
                                                      redis_client: redis.Redis) -> None:
    app = client_app(redis_url, key_prefix)
    env = worker_env(redis_url, key_prefix, lease_ms=1500)
    try:
        redis_client.set(probe_key(key_prefix, "hold", "o-3"), 1)
        with CeleryWorker(APP, pool="prefork", env=env) as doomed:
            result = app.tasks["reliable.effect"].delay("o-3", hold=True)
            wait_for(lambda: counter(redis_client, key_prefix, "started", "o-3"),
                     message=doomed.log_tail)
            doomed.kill()  # holds the entry and the idempotency claim
        duplicate = app.tasks["reliable.effect"].delay("o-3")
        redis_client.delete(probe_key(key_prefix, "hold", "o-3"))
        with CeleryWorker(APP, pool="prefork", concurrency=2, env=env) as survivor:
            # Whichever runs first takes the dead worker's claim over; the other is a duplicate.
            outcomes = {result.get(timeout=RESULT_TIMEOUT), duplicate.get(timeout=RESULT_TIMEOUT)}
            assert outcomes == {1, None}
            assert "is dead; taking the claim over" in survivor.log_text()
        assert counter(redis_client, key_prefix, "effects", "o-3") == 1
        assert counter(redis_client, key_prefix, "started", "o-3") == 2
    finally:
        app.close()


# ---------------------------------------------------------------------- retries


@pytest.mark.parametrize(("task", "fast"), [
    ("reliable.flaky", ["1", "2"]),  # a plain raise: the tiered policy's fast tier
    ("reliable.explicit", [None, None]),  # self.retry(): Celery's default_retry_delay
    ("reliable.auto", [None, None]),  # autoretry_for: the same
])
def test_every_way_to_fail_counts_retries_alike(app: Celery, worker: CeleryWorker,
                                                redis_client: redis.Redis, prefix: str,
                                                task: str, fast: list[str | None]) -> None:
    name = f"{task}-{uuid.uuid4().hex[:6]}"
    result = app.tasks[task].delay(name, 2)
    assert result.get(timeout=RESULT_TIMEOUT) == {"retries": 2, "fast": fast[-1]}
    seen = attempts(redis_client, prefix, name)
    assert [(a["retries"], a["fast"]) for a in seen] == [(0, None), (1, fast[0]), (2, fast[1])]
    assert seen[0]["first"] is None and seen[1]["first"] == seen[2]["first"]
    assert parse_rfc3339(seen[1]["first"]).timestamp() >= seen[0]["at"] - 1
    if fast[0] is None:
        assert all(gap >= 0.15 for gap in gaps_of(seen))  # the task's countdown, not at once


def test_fast_then_backoff_retries_then_the_dead_letter_stream(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    # reliable.transient: fast_retries 2, backoff_s 1 (jitter 0.8-1.2), max_retries 4.
    name = f"transient-{uuid.uuid4().hex[:6]}"
    result = app.tasks["reliable.transient"].delay(name)
    with pytest.raises(ConnectionError):
        result.get(timeout=RESULT_TIMEOUT)
    seen = attempts(redis_client, prefix, name)
    assert [a["retries"] for a in seen] == [0, 1, 2, 3, 4]
    gaps = gaps_of(seen)
    assert gaps[0] < 0.7 and gaps[1] < 0.7  # fast tier: at once
    assert gaps[2] >= 0.75 and gaps[3] >= 1.55  # backoff tier: ~1 s, then ~2 s
    assert gaps[3] > gaps[2]
    dead = wait_for(lambda: [d for d in dead_letters(redis_client, prefix, "celery")
                             if d.get("task_id") == result.id.encode()], message=worker.log_tail)
    fields = dead[0]
    assert fields["failure_class"] == b"transient_exhausted"
    assert fields["attempts"] == b"5"
    assert fields["exception_type"] == b"ConnectionError"
    assert b"cannot connect" in fields["reason"] and b"Traceback" in fields["traceback"]
    assert fields["first_failure_at"].decode() == seen[1]["first"]
    assert parse_rfc3339(fields["last_failure_at"].decode()) >= parse_rfc3339(seen[1]["first"])
    assert fields["language"] == b"python" and fields["consumer"] and fields["pid"]


def test_the_retry_cap_of_a_task_type_holds(app: Celery, worker: CeleryWorker,
                                            redis_client: redis.Redis, prefix: str) -> None:
    # reliable.capped: retry_concurrency 2; the worker runs four tasks at once.
    name = f"capped-{uuid.uuid4().hex[:6]}"
    results = [app.tasks["reliable.capped"].delay(name, 0.3) for _ in range(10)]
    assert [r.get(timeout=RESULT_TIMEOUT) for r in results] == [1] * 10  # never recounted
    assert counter(redis_client, prefix, "max", name) <= 2
    assert "retry slots are taken" in worker.log_text()


# --------------------------------------------------------------------- timeouts


def test_a_task_over_its_timeout_is_stopped_and_retried_prefork(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = f"slow-{uuid.uuid4().hex[:6]}"
    result = app.tasks["reliable.slow"].apply_async((name, 60, 1), soft_time_limit=0.5)
    assert result.get(timeout=RESULT_TIMEOUT) == 1
    assert len(attempts(redis_client, prefix, name)) == 2


def test_a_task_over_its_timeout_is_stopped_and_retried_solo(
        redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    app = client_app(redis_url, key_prefix)
    try:
        with CeleryWorker(APP, pool="solo", env=worker_env(redis_url, key_prefix)) as solo:
            # Published as another language would: timeout_ms in the Envelope.
            name = f"slow-{uuid.uuid4().hex[:6]}"
            envelope = Envelope.new(task_type="reliable.slow", timeout_ms=500,
                                    payload={"name": name, "seconds": 60, "until_retry": 1})
            Publisher(redis_client, Settings(key_prefix=key_prefix)).publish("celery", envelope)
            result = AsyncResult(envelope.task_id, app=app)
            assert result.get(timeout=RESULT_TIMEOUT) == 1
            assert len(attempts(redis_client, key_prefix, name)) == 2
            assert "SoftTimeLimitExceeded" in solo.log_text()
    finally:
        app.close()


def test_the_soft_limit_of_the_solo_pool_raises_in_the_task() -> None:
    before = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(SoftTimeLimitExceeded), soft_time_limit(0.05):
        time.sleep(5)
    assert time.monotonic() - started < 2
    with soft_time_limit(5):
        pass  # no limit left behind
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == before


# ---------------------------------------------------------------------- metrics


def test_outcomes_are_counted() -> None:
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    task_type = f"metrics.{uuid.uuid4().hex[:6]}"
    metrics.count("succeeded", task_type)
    metrics.count("duplicates", task_type)
    metrics.count("dead_lettered", task_type, "timeout")
    assert value("envelope_tasks_succeeded_total", task_type=task_type) == 1
    assert value("envelope_tasks_duplicates_total", task_type=task_type) == 1
    assert value("envelope_tasks_dead_lettered_total", task_type=task_type,
                 failure_class="timeout") == 1
