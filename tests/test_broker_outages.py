"""Real ``celery worker`` processes, with Celery's defaults, while the broker misbehaves.

Workers join while others run (mingle's transient reply queues come and go under
their blocking reads), Redis is SIGKILLed and restarted from its AOF while a task
runs, and Redis blips for a second during a task longer than the lease. Each test
counts effects in a second Redis that never goes away (the session's), and checks
that no worker exited.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from apps.crash_app import create_app, done_key, effect_key, started_key
from celery import Celery
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url, pending_count
from support.workers import CeleryWorker, worker_fleet

import celery_ext  # noqa: F401  (envelope:// for the publishing side)
from kombu_envelope.keys import KeySpace
from kombu_envelope.testing.redis_server import PrivateRedisServer

APP = "apps.crash_app"
QUEUE = "celery"


class Effects:
    """What crash_app's tasks recorded in the session Redis for one test."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def started(self, key: str) -> list[str]:
        return [v.decode() for v in self.client.lrange(started_key(self.prefix, key), 0, -1)]

    def done(self, key: str) -> list[str]:
        return [v.decode() for v in self.client.lrange(done_key(self.prefix, key), 0, -1)]

    def effect(self, key: str) -> int:
        return int(self.client.get(effect_key(self.prefix, key)) or 0)


def queue_is_settled(broker: redis.Redis, prefix: str) -> bool:
    """Nothing waiting or pending in the queue's task streams."""
    keys = KeySpace(prefix).queue(QUEUE)
    return all(broker.xlen(stream) == 0 and pending_count(broker, stream, "workers") == 0
               for stream in keys.task_streams)


@pytest.fixture
def effects(redis_client: redis.Redis, key_prefix: str) -> Effects:
    return Effects(redis_client, key_prefix)


@pytest.fixture
def broker() -> Iterator[PrivateRedisServer]:
    """The broker's own Redis (AOF, appendfsync always): killed and restarted by tests."""
    with PrivateRedisServer(appendonly=True) as server:
        yield server


@pytest.fixture
def workers(request: pytest.FixtureRequest, broker: PrivateRedisServer, redis_url: str,
            key_prefix: str) -> Iterator[Callable[..., CeleryWorker]]:
    """Makes crash_app workers on ``broker`` with Celery's defaults (mingle, gossip and
    heartbeat on), recording in the session Redis; stopped afterwards, their logs
    printed when the test failed."""

    def make(*, lease_ms: int, pool: str = "solo", concurrency: int = 1,
             **kwargs: Any) -> CeleryWorker:
        env = {"TEST_BROKER_URL": envelope_url(broker.url), "TEST_REDIS_URL": redis_url,
               "TEST_KEY_PREFIX": key_prefix, "TEST_LEASE_MS": str(lease_ms),
               "TEST_PREFETCH": "1"}
        worker = CeleryWorker(APP, pool=pool, concurrency=concurrency, env=env, **kwargs)
        created.append(worker)
        return worker

    with worker_fleet(request) as created:
        yield make


@pytest.fixture
def producer(broker: PrivateRedisServer, redis_url: str, key_prefix: str
             ) -> Iterator[Callable[[int], Celery]]:
    apps: list[Celery] = []

    def make(lease_ms: int) -> Celery:
        apps.append(create_app(envelope_url(broker.url), redis_url, key_prefix, lease_ms))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


def assert_no_unrecoverable_error(worker: CeleryWorker) -> None:
    log = worker.log_text()
    assert worker.is_alive(), log[-4000:]
    assert "Unrecoverable error" not in log, log[-4000:]


def test_workers_started_one_after_another_with_celery_defaults_all_stay_up(
    workers: Callable[..., CeleryWorker], producer: Callable[[int], Celery], effects: Effects,
) -> None:
    # Given workers with mingle, gossip and heartbeat on, each started while the
    # earlier ones run (every start sends a broadcast and reads replies from a
    # transient queue that is deleted afterwards, under the others' blocking reads)
    lease_ms = 5000
    app = producer(lease_ms)
    started = []
    for _ in range(4):
        started.append(workers(lease_ms=lease_ms).start())
        time.sleep(1)

    # When tasks are published after all of them joined
    keys = [f"k{i}" for i in range(12)]
    for key in keys:
        app.tasks["crash_app.record"].apply_async(kwargs={"key": key, "first_s": 0.2})

    # Then every task ran once, and every worker is still up and answers
    wait_for(lambda: all(effects.effect(key) == 1 for key in keys), timeout=30,
             message=lambda: "\n".join(w.log_tail() for w in started))
    replies = wait_for(lambda: app.control.inspect(timeout=2).ping(), timeout=20)
    assert set(replies) == {w.hostname for w in started}
    for key in keys:
        assert len(effects.started(key)) == 1, key
    for worker in started:
        assert_no_unrecoverable_error(worker)


def test_task_finishing_during_a_redis_outage_has_its_effect_once(
    broker: PrivateRedisServer, workers: Callable[..., CeleryWorker],
    producer: Callable[[int], Celery], effects: Effects, key_prefix: str,
) -> None:
    # Given a prefork worker running a 3 s task with an idempotency key
    lease_ms = 5000
    app = producer(lease_ms)
    worker = workers(lease_ms=lease_ms, pool="prefork", concurrency=2).start()
    app.tasks["crash_app.close_order"].apply_async(kwargs={"order_id": "o-1", "seconds": 3})
    wait_for(lambda: effects.started("o-1"), timeout=20, message=worker.log_tail)
    started_at = time.monotonic()

    # When Redis is SIGKILLed 1.5 s into the task and restarted from its AOF at 4.5 s
    time.sleep(max(0.0, started_at + 1.5 - time.monotonic()))
    broker.kill()
    wait_for(lambda: effects.done("o-1"), timeout=10,
             message="the task did not finish while Redis was down")
    time.sleep(max(0.0, started_at + 4.5 - time.monotonic()))
    broker.start()

    # Then its done marker and its ack land once Redis is back: nothing runs again,
    # not even after the lease, and nothing is dead-lettered
    with redis.Redis.from_url(broker.url) as client:
        wait_for(lambda: queue_is_settled(client, key_prefix), timeout=30,
                 message=worker.log_tail)
        idem = KeySpace(key_prefix).idempotency("crash_app.close_order", "o-1")
        wait_for(lambda: (client.get(idem) or b"").startswith(b"done "), timeout=10,
                 message=lambda: f"idempotency key is {client.get(idem)!r}")
        time.sleep(2 * lease_ms / 1000)
        assert dead_letters(client, key_prefix, QUEUE) == []
        assert queue_is_settled(client, key_prefix)
    assert effects.started("o-1") == [worker.hostname]
    assert effects.effect("o-1") == 1
    log = worker.log_text()
    assert "may have run twice" not in log
    assert "raised unexpected" not in log, log[-4000:]
    assert_no_unrecoverable_error(worker)


def test_task_longer_than_the_lease_across_a_one_second_blip_runs_once(
    broker: PrivateRedisServer, workers: Callable[..., CeleryWorker],
    producer: Callable[[int], Celery], effects: Effects, key_prefix: str,
) -> None:
    # Given a prefork worker with a free pool process, running a task three times
    # longer than the lease
    lease_ms = 3000
    app = producer(lease_ms)
    worker = workers(lease_ms=lease_ms, pool="prefork", concurrency=2).start()
    app.tasks["crash_app.record"].apply_async(kwargs={"key": "long", "first_s": 9,
                                                      "then_s": 0})
    wait_for(lambda: effects.started("long"), timeout=20, message=worker.log_tail)

    # When Redis is down for one second, 2 s into the task
    time.sleep(2)
    broker.kill()
    time.sleep(1)
    broker.start()

    # Then the worker rides the blip out (its blocking read is sent again on a new
    # connection once Redis answers, without Celery reconnecting), and the task is
    # neither handed to its other pool process nor to anybody else: one start, one
    # effect, acknowledged
    wait_for(lambda: effects.done("long"), timeout=30, message=worker.log_tail)
    with redis.Redis.from_url(broker.url) as client:
        wait_for(lambda: queue_is_settled(client, key_prefix), timeout=20,
                 message=worker.log_tail)
        time.sleep(lease_ms / 1000)
        assert queue_is_settled(client, key_prefix)
    assert effects.started("long") == [worker.hostname]
    assert effects.effect("long") == 1
    log = worker.log_text()
    assert "blocking read lost its connection" in log
    assert "Connection to broker lost" not in log
    assert_no_unrecoverable_error(worker)
