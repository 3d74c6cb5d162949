"""Celery app for the crash tests: late acknowledgement, records of every run in Redis.

The module does not import ``celery_ext``: a worker or any other ``celery -A
apps.crash_app ...`` command finds the ``envelope://`` transport through the
``celery`` command's plugin entry point, as the README promises.

Configured from the environment when loaded by a worker:

* ``TEST_BROKER_URL`` - ``envelope://...`` broker URL.
* ``TEST_REDIS_URL`` - ``redis://...`` URL of the Redis holding the run records
  (it may be another server than the broker's, one that never goes away).
* ``TEST_KEY_PREFIX`` - key prefix isolating one test's keys (broker and records).
* ``TEST_LEASE_MS`` - consumer lease of the ``envelope://`` transport.
* ``TEST_PREFETCH`` - ``worker_prefetch_multiplier``.

Run records of :func:`record` (``<prefix>:...`` keys): ``started:<key>`` lists the
worker hostnames that started the task, ``done:<key>`` those that finished it,
``effect:<key>`` counts the finished runs. :func:`close_order` records the same
under its ``order_id``.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, Task


def started_key(prefix: str, key: str) -> str:
    """List of the hostnames of the workers that started ``record(key)``."""
    return f"{prefix}:started:{key}"


def done_key(prefix: str, key: str) -> str:
    """List of the hostnames of the workers that finished ``record(key)``."""
    return f"{prefix}:done:{key}"


def effect_key(prefix: str, key: str) -> str:
    """Counter of the finished runs of ``record(key)``."""
    return f"{prefix}:effect:{key}"


def create_app(
    broker_url: str | None = None,
    redis_url: str | None = None,
    key_prefix: str | None = None,
    lease_ms: int | None = None,
    prefetch: int | None = None,
) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    redis_url = redis_url or os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    key_prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "crash")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "30000"))
    prefetch = prefetch or int(os.environ.get("TEST_PREFETCH", "1"))

    app = Celery("crash_app", broker=broker_url)
    app.conf.update(
        broker_transport_options={"key_prefix": key_prefix, "lease_ms": lease_ms},
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=prefetch,
    )
    clients: list[redis.Redis] = []

    def records() -> redis.Redis:
        if not clients:  # created in the process that runs tasks (after a fork)
            clients.append(redis.Redis.from_url(redis_url))
        return clients[0]

    @app.task(name="crash_app.record", shared=False, bind=True)
    def record(self: Task, key: str, first_s: float = 0.0, then_s: float = 0.0) -> None:
        """Record the start, sleep (``first_s`` on the first run, ``then_s`` on any
        later one), then record the effect."""
        starts = records().rpush(started_key(key_prefix, key), self.request.hostname)
        time.sleep(first_s if starts == 1 else then_s)
        pipe = records().pipeline(transaction=True)
        pipe.incr(effect_key(key_prefix, key))
        pipe.rpush(done_key(key_prefix, key), self.request.hostname)
        pipe.execute()

    @app.task(name="crash_app.close_order", shared=False, bind=True,
              idempotency_fields=("order_id",))
    def close_order(self: Task, order_id: str, seconds: float = 0.0) -> None:
        """``record`` for an order, with the order id as idempotency key: its effect
        must happen once however often it is delivered."""
        records().rpush(started_key(key_prefix, order_id), self.request.hostname)
        time.sleep(seconds)
        pipe = records().pipeline(transaction=True)
        pipe.incr(effect_key(key_prefix, order_id))
        pipe.rpush(done_key(key_prefix, order_id), self.request.hostname)
        pipe.execute()

    return app


app = create_app()
