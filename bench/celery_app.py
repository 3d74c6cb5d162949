"""The Celery app the benchmark workers run (``celery -A bench.celery_app worker``).

Configured from the environment, so one module serves every broker:

* ``BENCH_BROKER_URL``: broker URL (``envelope://``, ``redis://``, ``valkey://`` for
  celery-redis-plus, or ``pyamqp://``).
* ``BENCH_REDIS_URL``: Redis where tasks record what they did (counters, start times).
* ``BENCH_TRANSPORT_OPTIONS``: JSON object of broker transport options.
* ``BENCH_QUEUE``: the queue tasks go to and workers consume.
* ``BENCH_PREFETCH``: ``worker_prefetch_multiplier``.

Results are never stored (``task_ignore_result``): tasks report through plain
Redis commands on ``BENCH_REDIS_URL``, the same few commands whatever the broker.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

import celery_ext  # noqa: F401  (makes envelope:// the Celery-aware transport)
from bench import plus

#: Longest time :func:`hold` blocks (seconds).
HOLD_LIMIT_S = 300.0

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "memory://")
if BROKER_URL.startswith(f"{plus.SCHEME}://"):
    plus.load()

app = Celery("bench", broker=BROKER_URL)
app.conf.update(
    task_ignore_result=True,
    result_backend=None,
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    broker_transport_options=json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_client: tuple[int, redis.Redis] | None = None


def recorder() -> redis.Redis:
    """A Redis client for this process (a forked pool process makes its own)."""
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL",
                                                                    "redis://localhost")))
    return _client[1]


def run_key(run: str, name: str) -> str:
    """Key of one benchmark run's record ``name``."""
    return f"bench:{run}:{name}"


@worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    run = os.environ.get("BENCH_RUN")
    if run:
        recorder().set(run_key(run, f"ready:{sender.hostname if sender else 'worker'}"),
                       time.time())


@app.task(name="bench.noop", ignore_result=True)
def noop(run: str, total: int, data: dict[str, Any] | None = None) -> None:
    """Count one finished task; note the time of the first and of the ``total``-th."""
    client = recorder()
    done = client.incr(run_key(run, "done"))
    if done == 1:
        client.set(run_key(run, "first"), time.time())
    if done == total:
        client.set(run_key(run, "last"), time.time())


def wait_for_go(run: str) -> None:
    """Block until the key ``bench:<run>:go`` exists (at most :data:`HOLD_LIMIT_S`)."""
    client = recorder()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not client.exists(run_key(run, "go")) and time.monotonic() < deadline:
        time.sleep(0.005)


@app.task(name="bench.record", ignore_result=True)
def record(run: str, index: int, hold: bool = False,
           data: dict[str, Any] | None = None) -> None:
    """Note when task ``index`` started; with ``hold``, then wait for the go key."""
    recorder().zadd(run_key(run, "started"), {str(index): time.time()})
    if hold:
        wait_for_go(run)


@app.task(name="bench.hold", ignore_result=True)
def hold(run: str) -> None:
    """Keep this worker busy until the key ``bench:<run>:go`` exists."""
    recorder().set(run_key(run, "holding"), time.time())
    wait_for_go(run)
