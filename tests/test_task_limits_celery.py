"""Limits per task type with real ``celery worker`` processes (docs/protocol.md, section 19).

The workers run :mod:`apps.limits_app` with Celery's defaults (early acknowledgement, a
prefetch of four per process), so a slot must outlive the acknowledgement and never be
held by a prefetched task. What ran when is read from the spans the tasks record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import redis
from apps.limits_app import create_app
from celery import Celery
from kombu import Consumer, Queue
from support import wait_for
from support.envelope_streams import connect, drain_until, envelope_url
from support.spans import Span, max_overlap, spans
from support.workers import PROJECT_ROOT, TESTS_DIR, CeleryWorker

from kombu_envelope import Envelope, Publisher
from kombu_envelope.kombu.delivery_info import INFO_TASK_ID
from kombu_envelope.settings import Settings
from kombu_envelope.store.task_limits import TaskLimit, TaskLimits

APP = "apps.limits_app"
QUEUE = "limited"
LEASE_MS = 1500
SETTING = {"limits.task": {"concurrency": 2}}


def env(redis_url: str, prefix: str, limits: object = SETTING) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(LEASE_MS),
            "TEST_TASK_LIMITS": json.dumps(limits)}


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    with CeleryWorker(APP, pool="prefork", concurrency=4, queues=[QUEUE],
                      env=env(redis_url, prefix)) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix, LEASE_MS)
    yield app
    app.close()


@pytest.fixture
def limits(redis_client: redis.Redis, prefix: str) -> TaskLimits:
    return TaskLimits(redis_client, Settings(key_prefix=prefix, lease_ms=LEASE_MS))


def run_all(app: Celery, client: redis.Redis, prefix: str, tasks: list[tuple[str, int]],
            queue: str = QUEUE, timeout: float = 30) -> list[Span]:
    """Publish ``(task name, sleep ms)`` in order and wait for all their spans."""
    ids = [app.send_task(name, kwargs={"sleep_ms": ms}, queue=queue).id for name, ms in tasks]
    wanted = set(ids)

    def done() -> list[Span] | None:
        ran = [span for span in spans(client, prefix) if span.task_id in wanted]
        return ran if len(ran) >= len(ids) else None

    ran = wait_for(done, timeout=timeout, message=f"{len(ids)} tasks ran")
    assert sorted(span.task_id for span in ran) == sorted(ids)  # each exactly once
    return ran


def celery_cli(redis_url: str, prefix: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "envelope", *args], cwd=PROJECT_ROOT,
        env={**os.environ, **env(redis_url, prefix),
             "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)])},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_cap_holds_and_other_types_flow_past(worker, app, redis_client, prefix,
                                                  limits) -> None:
    assert limits.get(QUEUE, "limits.task") == TaskLimit(concurrency=2)  # from the setting
    ran = run_all(app, redis_client, prefix,
                  [("limits.task", 300)] * 10 + [("limits.fast", 40)] * 8)
    slow = [s for s in ran if s.task_id and s in ran and s.end_ms - s.start_ms >= 250]
    fast = [s for s in ran if s not in slow]
    assert len(slow) == 10 and len(fast) == 8
    assert max_overlap(slow) == 2, slow
    # The fast ones ran on the free processes, not after the backlog of slow ones.
    assert max(s.end_ms for s in fast) < sorted(s.end_ms for s in slow)[3]


def test_a_limit_changed_at_run_time_takes_effect(worker, app, redis_client, prefix,
                                                   redis_url) -> None:
    out = celery_cli(redis_url, prefix, "limits", "set", "limits.task", "-Q", QUEUE,
                     "--concurrency", "3")
    assert "concurrency 3" in out
    assert json.loads(celery_cli(redis_url, prefix, "limits", "show", "-Q", QUEUE,
                                 "--json")) == {"limits.task": {"concurrency": 3}}
    ran = run_all(app, redis_client, prefix, [("limits.task", 400)] * 9)
    assert max_overlap(ran) == 3
    celery_cli(redis_url, prefix, "limits", "set", "limits.task", "-Q", QUEUE,
               "--concurrency", "2")


def test_a_slot_outlives_the_lease_and_the_early_acknowledgement(worker, app, redis_client,
                                                                  prefix, limits) -> None:
    limits.set(QUEUE, "limits.fast", TaskLimit(concurrency=1))
    try:
        ran = run_all(app, redis_client, prefix, [("limits.fast", 2 * LEASE_MS)] * 2)
    finally:
        limits.remove(QUEUE, "limits.fast")
    assert max_overlap(ran) == 1, ran  # the slot was renewed while the first one ran


def test_the_slots_of_a_killed_worker_come_back_after_the_lease(redis_url, app, redis_client,
                                                                 prefix, limits) -> None:
    queue = f"killed-{uuid.uuid4().hex[:6]}"
    limits.set(queue, "limits.task", TaskLimit(concurrency=1))
    running = Settings(key_prefix=prefix).keys.queue(queue).running("limits.task")
    victim = CeleryWorker(APP, pool="prefork", concurrency=2, queues=[queue],
                          env=env(redis_url, prefix, {})).start()
    try:
        first = app.send_task("limits.task", kwargs={"sleep_ms": 4_000}, queue=queue).id
        wait_for(lambda: redis_client.zcard(running) == 1, timeout=20, message="a slot taken")
        for process in [*victim.children(), psutil.Process(victim.pid)]:
            process.send_signal(signal.SIGKILL)
        deadline_ms = redis_client.zrange(running, 0, 0, withscores=True)[0][1]
    finally:
        victim.close()
    second = app.send_task("limits.task", kwargs={"sleep_ms": 10}, queue=queue).id
    with CeleryWorker(APP, pool="solo", queues=[queue], env=env(redis_url, prefix, {})):
        (span,) = wait_for(lambda: [s for s in spans(redis_client, prefix)
                                    if s.task_id == second] or None,
                           timeout=LEASE_MS / 1000 + 20, message="the next task ran")
    assert span.start_ms >= deadline_ms - 20  # never while the dead worker's slot stood
    # Killed before its early acknowledgement, the first task is taken over and runs again
    # (after it, holding the slot); killed after it, it is lost, as Celery documents.
    ran = [s for s in spans(redis_client, prefix) if s.task_id in (first, second)]
    assert max_overlap(ran) == 1 and len(ran) <= 2, ran


def test_a_misspelt_limit_stops_the_worker_naming_it(redis_url, prefix) -> None:
    worker = CeleryWorker(APP, queues=["misspelt"],
                          env=env(redis_url, prefix, {"limits.task": {"concurency": 2}}))
    worker.start(wait_ready=False)
    try:
        wait_for(lambda: worker.returncode is not None, timeout=60, message="the worker exited")
        assert worker.returncode != 0
        assert "limits.task" in worker.log_text() and "concurency" in worker.log_text()
        assert "unknown_field" in worker.log_text()
    finally:
        worker.close()


def test_a_breaker_opens_on_a_failing_downstream_and_closes_when_it_recovers(
        redis_url: str, redis_client: redis.Redis, prefix: str, limits: TaskLimits) -> None:
    queue = f"breaker-{uuid.uuid4().hex[:6]}"
    cooldown_s = 3.0
    setting = {"limits.flaky": {"breaker": {"failure_ratio": 0.5, "min_attempts": 4,
                                            "window_s": 30, "cooldown_s": cooldown_s}}}
    app = create_app(envelope_url(redis_url), redis_url, prefix, LEASE_MS)
    sick = f"{prefix}:mx:fail"
    redis_client.set(sick, 1)
    try:
        with CeleryWorker(APP, pool="prefork", concurrency=2, queues=[queue],
                          env=env(redis_url, prefix, setting)) as worker:
            for _ in range(6):
                app.send_task("limits.flaky", queue=queue)
            wait_for(lambda: limits.breaker_state(queue, "limits.flaky") == "open", timeout=20,
                     message=worker.log_tail)
            key = Settings(key_prefix=prefix).keys.queue(queue).breaker("limits.flaky")
            opened = float(redis_client.hget(key, "since"))  # Redis' clock, this machine's
            redis_client.delete(sick)  # the downstream recovers
            later = [app.send_task("limits.flaky", queue=queue).id for _ in range(3)]
            ran = wait_for(lambda: [s for s in spans(redis_client, prefix) if s.task_id in later]
                           if len([s for s in spans(redis_client, prefix)
                                   if s.task_id in later]) == 3 else None,
                           timeout=cooldown_s + 20, message=worker.log_tail)
    finally:
        app.close()
    first = min(ran, key=lambda s: s.start_ms)
    assert first.start_ms >= opened + cooldown_s * 1000 - 50  # nothing during the cool-down
    # The probe alone, then the rest once its success was counted.
    assert all(s.start_ms >= first.end_ms for s in ran if s is not first)
    assert limits.breaker_state(queue, "limits.flaky") == "closed"


def test_a_plain_kombu_consumer_in_a_celery_app_process_frees_its_slot_with_its_ack(
        redis_url: str, redis_client: redis.Redis) -> None:
    """This process imports a Celery app (``envelope://`` is Celery's transport here) but
    runs no worker, so no execution shell frees slots: a plain kombu consumer's
    acknowledgement does, and each task parked behind a cap of one is delivered in turn."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    settings = Settings(key_prefix=prefix)
    TaskLimits(redis_client, settings).set("plain", "plain.task", TaskLimit(concurrency=1))
    publisher = Publisher(redis_client, settings)
    tasks = [Envelope.new(task_type="plain.task", payload={}) for _ in range(3)]
    for task in tasks:
        publisher.publish("plain", task)
    running = settings.keys.queue("plain").running("plain.task")
    got: list[str] = []

    def on_message(_body: Any, message: Any) -> None:
        assert redis_client.zcard(running) == 1  # its own slot, and no other
        got.append(message.delivery_info[INFO_TASK_ID])
        message.ack()

    with connect(redis_url, prefix) as conn, Consumer(conn, [Queue("plain")],
                                                       callbacks=[on_message]):
        drain_until(conn, lambda: len(got) == 3, timeout=20)
    assert got == [task.task_id for task in tasks]
    assert redis_client.zcard(running) == 0
