"""``GET /metrics`` (docs/monitoring/metrics.md) against a real Redis, a real uvicorn process and a
real prefork Celery worker: a known workload gives exactly the expected figures."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from apps.reliable_app import create_app
from prometheus_client.parser import text_string_to_metric_families
from support import wait_for
from support.announce import announce
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from kombu_envelope import Settings
from kombu_envelope.dispatcher.metrics import render
from kombu_envelope.keys import Bucket
from kombu_envelope.store.scripts import script
from kombu_envelope.store.task_limits import Breaker, TaskLimit, TaskLimits
from kombu_envelope.testing.dispatcher import DispatcherProcess
from kombu_envelope.testing.redis_server import PrivateRedisServer

READ = "r-" + "m" * 30
PREFIX = f"t-met-{uuid.uuid4().hex[:8]}"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, [{"name": "reader", "scope": "read", "token": READ}],
                           {"key_prefix": PREFIX}) as proc:
        yield proc


def scrape(server: DispatcherProcess) -> Samples:
    answer = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {READ}"},
                       timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(answer.text)
            for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_a_known_workload_gives_exactly_the_expected_figures(
        server: DispatcherProcess, redis_url: str, redis_client: redis.Redis) -> None:
    queue, idle = f"q-{uuid.uuid4().hex[:8]}", f"idle-{uuid.uuid4().hex[:8]}"
    keys = Settings(key_prefix=PREFIX).keys
    # A queue nobody consumes now: its group exists (a worker read it once) and a
    # recently seen worker that is not live announces it.
    redis_client.xgroup_create(keys.queue(idle).stream(Bucket.NORMAL), "workers", id="0",
                               mkstream=True)
    announce(redis_url, PREFIX, idle, {"reliable.slow": []})
    app = create_app(envelope_url(redis_url), redis_url, PREFIX, 1500)
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": PREFIX, "TEST_LEASE_MS": "1500", "TEST_ACKS_LATE": "0"}
    try:
        for _ in range(2):
            app.tasks["reliable.slow"].apply_async(("backlog", 0), queue=idle)
        with CeleryWorker("apps.reliable_app", pool="prefork", concurrency=2, queues=[queue],
                          env=env) as worker:
            slow, effect = app.tasks["reliable.slow"], app.tasks["reliable.effect"]
            for result in [slow.apply_async(("ok", 0), queue=queue) for _ in range(3)]:
                assert result.get(timeout=15) == 0
            assert effect.apply_async(("o-1",), queue=queue).get(timeout=15) == 1
            assert effect.apply_async(("o-1",), queue=queue).get(timeout=15) is None
            failing = app.tasks["reliable.retry_then_fail"].apply_async(
                ("m", 0.3), queue=queue)
            with pytest.raises(ValueError):
                failing.get(timeout=15)
            slow.apply_async(("later", 0), queue=queue, countdown=3600)
            expected = {
                ("kombu_envelope_tasks_succeeded_total", "reliable.slow"): 3,
                ("kombu_envelope_tasks_succeeded_total", "reliable.effect"): 1,
                ("kombu_envelope_tasks_duplicates_skipped_total", "reliable.effect"): 1,
                ("kombu_envelope_tasks_failed_total", "reliable.retry_then_fail"): 2,
                ("kombu_envelope_tasks_retried_total", "reliable.retry_then_fail"): 1,
                ("kombu_envelope_tasks_dead_lettered_total", "reliable.retry_then_fail"): 1,
                ("kombu_envelope_task_run_duration_seconds_count", "reliable.slow"): 3,
                ("kombu_envelope_task_run_duration_seconds_count", "reliable.effect"): 1,
                ("kombu_envelope_task_run_duration_seconds_count",
                 "reliable.retry_then_fail"): 2,
                ("kombu_envelope_task_start_delay_seconds_count", "reliable.slow"): 3,
                ("kombu_envelope_task_start_delay_seconds_count", "reliable.effect"): 1,
            }

            def counted() -> dict[tuple[str, str], float | None]:
                samples = scrape(server)
                return {(name, task): value(samples, name, queue=queue, task_type=task,
                                            language="python") for name, task in expected}

            wait_for(lambda: counted() == expected, timeout=10,
                     message=lambda: f"{counted()} != {expected}")
            samples = scrape(server)
            consumer = next(dict(labels)["consumer"] for (name, labels), up in samples.items()
                            if name == "kombu_envelope_worker_up" and up == 1)
            worker_labels = {"consumer": consumer, "language": "python",
                             "host": dict(next(labels for (name, labels) in samples
                                               if name == "kombu_envelope_worker_up"
                                               and dict(labels)["consumer"] == consumer))["host"]}
            assert value(samples, "kombu_envelope_worker_heartbeat_period_seconds",
                         **worker_labels) == 0.5
            assert 0 <= value(samples, "kombu_envelope_worker_last_seen_seconds",
                              **worker_labels) < 2
            assert value(samples, "kombu_envelope_workers", queue=queue, language="python") == 1
            assert worker.is_alive()
    finally:
        app.close()
    samples = scrape(server)
    streams = {"queue": queue, "bucket": "normal", "group": "workers"}
    assert value(samples, "kombu_envelope_queue_backlog_entries", **streams) == 0
    assert value(samples, "kombu_envelope_queue_pending_entries", **streams) == 0
    assert value(samples, "kombu_envelope_queue_oldest_pending_age_seconds", **streams) == 0
    assert value(samples, "kombu_envelope_queue_backlog_entries",
                 **{**streams, "queue": idle}) == 2
    assert value(samples, "kombu_envelope_queue_delayed_tasks", queue=queue) == 1
    assert value(samples, "kombu_envelope_queue_promotion_lateness_seconds", queue=queue) == 0
    assert value(samples, "kombu_envelope_queue_dead_letters", queue=queue) == 1
    assert value(samples, "kombu_envelope_queue_dead_letters", queue=idle) == 0
    assert value(samples, "kombu_envelope_workers", queue=idle, language="python") == 0
    labels = {"queue": queue, "task_type": "reliable.retry_then_fail", "language": "python"}
    assert value(samples, "kombu_envelope_task_run_duration_seconds_bucket",
                 **labels, le="+Inf") == 2
    assert value(samples, "kombu_envelope_task_run_duration_seconds_sum", **labels) > 0
    # The worker stopped cleanly: it is no longer listed; its counts stay.
    assert not [labels for (name, labels), up in samples.items()
                if name == "kombu_envelope_worker_up" and up == 1]
    assert value(samples, "kombu_envelope_tasks_succeeded_total", queue=queue,
                 task_type="reliable.slow", language="python") == 3
    assert value(samples, "kombu_envelope_scrape_duration_seconds") > 0


def test_metrics_need_a_read_token(server: DispatcherProcess) -> None:
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401


def test_a_scrape_that_cannot_reach_redis_answers_503() -> None:
    with PrivateRedisServer() as private, DispatcherProcess(
            private.url, options={"outage_tolerance_s": 0.5}) as proc:
        private.stop()
        answer = httpx.get(f"{proc.url}/metrics", timeout=20)
    assert answer.status_code == 503
    assert answer.json()["error"] == "redis_unavailable"
    assert "Redis cannot be read" in answer.json()["message"]


def test_backlog_is_counted_when_redis_does_not_know_the_lag_and_pending_has_an_age(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    queue = "q-lag"
    stream = settings.keys.queue(queue).stream(Bucket.HIGH)
    ids = [redis_client.xadd(stream, {"n": n}) for n in range(4)]
    redis_client.xgroup_create(stream, "workers", id="0")
    redis_client.xreadgroup("workers", "c-1", {stream: ">"}, count=1)
    redis_client.xdel(stream, ids[2])  # a deleted entry past the group: Redis' lag is nil
    assert redis_client.xinfo_groups(stream)[0]["lag"] is None
    redis_client.sadd(settings.keys.queues, queue)
    page = render(redis_client, settings).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    labels = {"queue": queue, "bucket": "high", "group": "workers"}
    assert value(samples, "kombu_envelope_queue_backlog_entries", **labels) == 2
    assert value(samples, "kombu_envelope_queue_pending_entries", **labels) == 1
    assert 0 <= value(samples, "kombu_envelope_queue_oldest_pending_age_seconds", **labels) < 5
    assert value(samples, "kombu_envelope_queue_delayed_tasks", queue=queue) == 0


def test_slots_held_and_tasks_parked_of_a_limited_type(redis_client: redis.Redis,
                                                       key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    queue = "q-limited"
    keys = settings.keys.queue(queue)
    TaskLimits(redis_client, settings).set(queue, "slow", TaskLimit(concurrency=2))
    for stream in keys.task_streams:
        redis_client.xgroup_create(stream, "workers", "0", mkstream=True)
    for _ in range(5):
        redis_client.xadd(keys.stream(Bucket.NORMAL), {"v": "1", "enc": "json",
                                                       "body": '{"task_type": "slow"}'})
    script(redis_client, "read")(keys=list(keys.task_streams), args=["workers", "c-1", 10, 30_000])
    redis_client.sadd(settings.keys.queues, queue)
    page = render(redis_client, settings).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    labels = {"queue": queue, "task_type": "slow"}
    assert value(samples, "kombu_envelope_limit_running_attempts", **labels) == 2
    assert value(samples, "kombu_envelope_limit_parked_tasks", **labels) == 3
    assert value(samples, "kombu_envelope_queue_pending_entries", queue=queue, bucket="normal",
                 group="workers") == 5  # the parked ones are pending to 'parked'
    assert value(samples, "kombu_envelope_limit_breaker_open", **labels) is None  # none
    TaskLimits(redis_client, settings).set(queue, "slow", TaskLimit(
        concurrency=2, breaker=Breaker(failure_ratio=0.5)))
    script(redis_client, "read")(keys=list(keys.task_streams), args=["workers", "c-1", 10, 30_000])
    redis_client.hset(keys.breaker("slow"), "state", "half_open")
    page = render(redis_client, settings).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(page) for s in family.samples}
    assert value(samples, "kombu_envelope_limit_breaker_open", **labels) == 0.5
