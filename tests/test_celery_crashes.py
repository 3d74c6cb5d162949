"""Real ``celery worker`` processes on ``envelope://`` that crash, stop or lose Redis.

The app (apps/crash_app.py) acknowledges late and rejects tasks of lost workers;
its ``record`` task notes in Redis which worker started and finished it, so a
test can tell who ran what, and how many times.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import psutil
import pytest
import redis
from apps.crash_app import create_app, done_key, effect_key, started_key
from celery import Celery
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url, pending_count
from support.workers import PROJECT_ROOT, CeleryWorker, worker_fleet

import celery_ext  # noqa: F401  (envelope:// for the publishing side)
from kombu_envelope.codec import decode_entry
from kombu_envelope.keys import KeySpace
from kombu_envelope.testing.redis_server import PrivateRedisServer

APP = "apps.crash_app"
QUEUE = "celery"
RECORD = "crash_app.record"


def _text(values: Any) -> list[str]:
    return [value.decode() for value in values]


class Records:
    """What ``crash_app.record`` wrote for one test (its key prefix)."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def started(self, key: str) -> list[str]:
        return _text(self.client.lrange(started_key(self.prefix, key), 0, -1))

    def done(self, key: str) -> list[str]:
        return _text(self.client.lrange(done_key(self.prefix, key), 0, -1))

    def effect(self, key: str) -> int:
        return int(self.client.get(effect_key(self.prefix, key)) or 0)

    def queue_is_empty(self) -> bool:
        """Nothing waiting, nothing pending, nothing delayed in the queue's keys."""
        keys = KeySpace(self.prefix).queue(QUEUE)
        return all(self.client.xlen(stream) == 0 and pending_count(self.client, stream, "workers")
                   == 0 for stream in keys.all_streams) and not self.client.zcard(keys.delayed)

    def dead_letters(self) -> list[dict[str, bytes]]:
        return dead_letters(self.client, self.prefix, QUEUE)


def worker_env(redis_url: str, prefix: str, lease_ms: int, prefetch: int = 1) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_REDIS_URL": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(lease_ms),
            "TEST_PREFETCH": str(prefetch)}


@pytest.fixture
def workers(request: pytest.FixtureRequest, redis_url: str, key_prefix: str
            ) -> Iterator[Callable[..., CeleryWorker]]:
    """Creates crash_app workers (not started); all are stopped afterwards and their
    logs printed when the test failed."""

    def make(*, lease_ms: int, url: str = redis_url, prefetch: int = 1, pool: str = "solo",
             **kwargs: Any) -> CeleryWorker:
        worker = CeleryWorker(APP, pool=pool, concurrency=1,
                              env=worker_env(url, key_prefix, lease_ms, prefetch), **kwargs)
        created.append(worker)
        return worker

    with worker_fleet(request) as created:
        yield make


@pytest.fixture
def records(redis_client: redis.Redis, key_prefix: str) -> Records:
    return Records(redis_client, key_prefix)


@pytest.fixture
def publisher(redis_url: str, key_prefix: str) -> Iterator[Callable[..., Celery]]:
    """Makes the publishing side (the same app module as the workers); closed afterwards."""
    apps: list[Celery] = []

    def make(lease_ms: int, url: str = redis_url) -> Celery:
        apps.append(create_app(envelope_url(url), url, key_prefix, lease_ms))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


def publish(app: Celery, key: str, first_s: float = 0.0, then_s: float = 0.0) -> str:
    result = app.tasks[RECORD].apply_async(
        kwargs={"key": key, "first_s": first_s, "then_s": then_s})
    return str(result.id)


def start_all(*workers: CeleryWorker) -> None:
    """Start workers side by side (startup is the slow part) and wait until all are ready."""
    for worker in workers:
        worker.start(wait_ready=False)
    for worker in workers:
        worker.wait_ready()


# ------------------------------------------------------------------ crashes


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_task_of_a_killed_worker_is_redelivered_after_the_lease(
    workers: Callable[..., CeleryWorker], publisher: Callable[..., Celery], records: Records,
    pool: str,
) -> None:
    lease_ms = 1500
    app = publisher(lease_ms)
    first = workers(lease_ms=lease_ms, pool=pool).start()
    publish(app, "job", first_s=60, then_s=0.2)  # only the first run hangs
    wait_for(lambda: records.started("job") == [first.hostname], timeout=20,
             message=first.log_tail)
    second = workers(lease_ms=lease_ms, pool=pool).start()
    victims = [psutil.Process(first.pid), *first.children()]
    assert len(victims) == (2 if pool == "prefork" else 1)

    killed_at = time.monotonic()
    first.kill()  # SIGKILL to the main process and its pool children
    _gone, alive = psutil.wait_procs(victims, timeout=10)
    assert alive == []
    wait_for(lambda: len(records.started("job")) == 2, timeout=15,
             message="the task was never redelivered")
    # Not before the dead worker's liveness key expired: it was renewed at most lease/3
    # before the kill (the entry itself has been idle for longer than the lease by now).
    assert time.monotonic() - killed_at >= 2 / 3 * lease_ms / 1000 - 0.1
    assert records.started("job") == [first.hostname, second.hostname]
    wait_for(lambda: records.done("job") == [second.hostname], timeout=15,
             message="the redelivered task never finished")
    wait_for(records.queue_is_empty, message="the redelivered task was not acknowledged")
    assert records.effect("job") == 1
    assert "took over 1 entries of dead consumer" in second.log_text()
    assert records.dead_letters() == []


def test_task_longer_than_the_lease_on_a_live_worker_runs_exactly_once(
    workers: Callable[..., CeleryWorker], publisher: Callable[..., Celery], records: Records,
) -> None:
    lease_ms = 1000
    app = publisher(lease_ms)
    both = workers(lease_ms=lease_ms), workers(lease_ms=lease_ms)
    start_all(*both)
    publish(app, "long", first_s=6, then_s=6)

    wait_for(lambda: records.done("long"), timeout=20, message="the long task never ended")
    wait_for(records.queue_is_empty, message="the long task was not acknowledged")
    assert len(records.started("long")) == 1
    assert records.effect("long") == 1
    for worker in both:
        assert "took over" not in worker.log_text()
        assert "when acknowledged" not in worker.log_text()  # an ack that found it gone


def _keys_in_queue(client: redis.Redis, prefix: str, pending: bool) -> list[str]:
    """The ``key`` argument of the tasks read and not acknowledged yet (``pending``), or of
    all the tasks in the queue's streams."""
    keys: list[str] = []
    for stream in KeySpace(prefix).queue(QUEUE).task_streams:
        entries: Any = client.xrange(stream)
        if pending:
            pending_ids = {item["message_id"] for item in client.xpending_range(
                stream, "workers", min="-", max="+", count=100)} if entries else set()
            entries = [(entry_id, fields) for entry_id, fields in entries
                       if entry_id in pending_ids]
        keys.extend(decode_entry(fields).payload["key"] for _, fields in entries)
    return sorted(keys)


def test_warm_shutdown_gives_prefetched_tasks_to_another_worker_at_once(
    workers: Callable[..., CeleryWorker], publisher: Callable[..., Celery], records: Records,
    redis_client: redis.Redis, key_prefix: str,
) -> None:
    lease_ms = 30_000
    app = publisher(lease_ms)
    keys = [f"t{n}" for n in range(6)]
    for key in keys:  # all waiting before the worker starts: its first reads prefetch 4
        publish(app, key, first_s=1, then_s=1)
    leaving = workers(lease_ms=lease_ms, prefetch=4).start()

    def running_and_prefetched() -> tuple[list[str], list[str]] | None:
        running = [key for key in keys if records.started(key) and not records.done(key)]
        pending = _keys_in_queue(redis_client, key_prefix, pending=True)
        if len(running) == 1 and len(pending) == 4:
            return running, sorted(set(pending) - set(running))
        return None

    found = wait_for(running_and_prefetched, timeout=20,
                     message="the worker did not prefetch 4 tasks")
    assert found is not None
    running, prefetched = found
    # SIGTERM at once (the running task has just started and sleeps 1 s): the worker
    # finishes it, starts no other, and gives the prefetched ones back as it closes.
    assert leaving.stop() == 0
    stopped_at = time.monotonic()
    ran_by_leaving = sorted(key for key in keys if records.started(key))
    assert ran_by_leaving == running
    assert records.done(running[0]) == [leaving.hostname]
    assert _keys_in_queue(redis_client, key_prefix, pending=True) == []
    assert _keys_in_queue(redis_client, key_prefix, pending=False) == sorted(
        set(keys) - set(running))

    staying = workers(lease_ms=lease_ms).start()
    wait_for(lambda: all(records.done(key) for key in keys), timeout=20,
             message="not every task ran")
    # One task after the other on a solo worker, each 1 s: far less than the 30 s lease.
    assert time.monotonic() - stopped_at < 15 < lease_ms / 1000
    for key in prefetched:
        assert records.started(key) == [staying.hostname]
    for key in keys:
        assert len(records.started(key)) == 1, key
        assert records.effect(key) == 1, key
    wait_for(records.queue_is_empty, message="the tasks were not all acknowledged")
    assert records.dead_letters() == []


def test_worker_survives_a_redis_restart(
    private_redis: PrivateRedisServer,  # first: torn down after the worker stopped
    workers: Callable[..., CeleryWorker], publisher: Callable[..., Celery], key_prefix: str,
) -> None:
    url = private_redis.url
    lease_ms = 3000
    app = publisher(lease_ms, url)
    worker = workers(lease_ms=lease_ms, url=url).start()
    with redis.Redis.from_url(url) as client:
        records = Records(client, key_prefix)
        before = ["b0", "b1", "b2"]
        for key in before:
            publish(app, key)
        wait_for(lambda: all(records.effect(key) == 1 for key in before), timeout=20,
                 message="the tasks published before the restart did not run")
        wait_for(records.queue_is_empty, message="the first tasks were not acknowledged")

        private_redis.restart()  # same port; the AOF brings the data back
        after = ["a0", "a1", "a2"]
        for key in after:
            publish(app, key)
        wait_for(lambda: all(records.effect(key) == 1 for key in after), timeout=30,
                 message="the tasks published after the restart did not run")
        wait_for(records.queue_is_empty, message="the last tasks were not acknowledged")
        for key in before + after:
            assert records.effect(key) == 1, key
            assert records.started(key) == [worker.hostname], key
        # Remote control came back too.
        replies = wait_for(
            lambda: app.control.inspect(destination=[worker.hostname], timeout=1).ping(),
            timeout=20, message=worker.log_tail)
        assert replies == {worker.hostname: {"ok": "pong"}}
    log = worker.log_text()
    # The blocking read is sent again on a new connection once Redis answers: the worker
    # rides the restart out without Celery reconnecting.
    assert "blocking read lost its connection" in log
    assert "Connection to broker lost" not in log
    assert "Error on restarting" not in log, log
    assert worker.is_alive()


# ----------------------------------------------------------- command line


def celery_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, *args]


def _collect(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def test_celery_command_line_against_a_running_worker(
    workers: Callable[..., CeleryWorker], publisher: Callable[..., Celery], records: Records,
    redis_client: redis.Redis, key_prefix: str,
) -> None:
    lease_ms = 5000
    app = publisher(lease_ms)
    worker = workers(lease_ms=lease_ms, extra_args=["-E"]).start()
    env = worker.environ()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(celery_command(*args), env=env, cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=60, check=False)

    ping = run("inspect", "ping", "--destination", worker.hostname, "--timeout", "5", "--json")
    assert ping.returncode == 0, ping.stderr
    assert json.loads(ping.stdout) == {worker.hostname: {"ok": "pong"}}

    dump = subprocess.Popen(celery_command("events", "--dump"), env=env,
                            cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=_collect, args=(dump.stdout, lines), daemon=True)
    reader.start()
    try:
        # The worker's gossip binds "worker.#" to the same exchange; the dump binds "#".
        events_binding = KeySpace(key_prefix).binding("celeryev")
        wait_for(lambda: any(member.startswith(b"#")
                             for member in redis_client.smembers(events_binding)),
                 timeout=30,
                 message=lambda: "events --dump never bound its queue:\n" + "".join(lines))
        task_id = publish(app, "watched")
        wait_for(lambda: any(task_id in line and "task succeeded" in line for line in lines),
                 timeout=20, message=lambda: "no task event was dumped:\n" + "".join(lines))
    finally:
        dump.send_signal(signal.SIGINT)
        try:
            dump.wait(timeout=20)
        except subprocess.TimeoutExpired:
            dump.kill()
            dump.wait()
        reader.join(10)
        if dump.stdout is not None:
            dump.stdout.close()
    assert any(task_id in line and f"{RECORD}(" in line and "task received" in line
               for line in lines), "".join(lines)

    shutdown = run("control", "shutdown", "--destination", worker.hostname)
    # The worker stops instead of replying, so the command waits in vain and exits with
    # status 69, exactly as it does with Celery's stock redis:// transport.
    assert shutdown.returncode == 0 or "No nodes replied" in shutdown.stderr, shutdown.stderr
    wait_for(lambda: not worker.is_alive(), timeout=20, message=worker.log_tail)
    assert worker.returncode == 0
    assert records.effect("watched") == 1
