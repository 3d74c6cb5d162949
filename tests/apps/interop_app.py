"""Celery app for the cross-language tests: tasks the Go and Node peers also know.

Configured from the environment when loaded by a worker (see ``envelope_app``):
``TEST_BROKER_URL`` (``envelope://...``), ``TEST_RESULT_BACKEND`` (``redis://...``; its
Redis also holds the effects and probes), ``TEST_KEY_PREFIX`` and ``TEST_LEASE_MS``.
Tasks are acknowledged late; retries use short delays.

* ``order.close_timeout`` has the same effect as the peers' built-in handler:
  ``INCR <prefix>:effects:order.close_timeout:<order_id>`` and
  ``RPUSH <prefix>:effects:log py:<task_id>``; with ``hold_ms`` (which the peers
  ignore) it first sets ``<prefix>:probe:started:<order_id>`` and waits that long.
* ``test.fail`` always fails with :class:`TestFailure`, like the peers' handler.
* ``interop.stamp`` records when it started (Redis ``TIME``, ms) and its trace id in
  the hash ``<prefix>:probe:stamp:<task_id>``, and logs one line.

Worker log lines show the trace id (``[trace_id=...]``).
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import Any

import redis
from celery import Celery, Task
from celery.utils.log import get_task_logger

import celery_ext  # noqa: F401  (envelope:// URLs, trace ids, the execution shell)

LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] [trace_id=%(trace_id)s] %(message)s"
TASK_LOG_FORMAT = (
    "[%(asctime)s: %(levelname)s/%(processName)s] %(task_name)s[%(task_id)s] "
    "[trace_id=%(trace_id)s] %(message)s"
)
#: Short retry delays (the peers' workers are started with a 200 ms backoff too).
RETRY_POLICY = {"fast_retries": 2, "backoff_s": 0.2, "max_backoff_s": 1.0}

logger = get_task_logger(__name__)


class TestFailure(Exception):
    """The error of ``test.fail``: not transient, so retried on the backoff tier."""


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None, lease_ms: int | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or "redis://"
    prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "5000"))

    app = Celery("interop_app", broker=broker_url, backend=backend)
    app.conf.update(
        broker_transport_options={"key_prefix": prefix, "lease_ms": lease_ms},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        broker_connection_retry_on_startup=True,
        result_expires=600,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        envelope_retry_policy=RETRY_POLICY,
        envelope_idempotency_defer=0.3,
        worker_log_format=LOG_FORMAT,
        worker_task_log_format=TASK_LOG_FORMAT,
    )

    @cache
    def probe() -> redis.Redis:
        return redis.Redis.from_url(backend)

    @app.task(name="order.close_timeout", shared=False, bind=True)
    def close_timeout(self: Task, order_id: str | int, store_id: Any = None,
                      hold_ms: int = 0) -> str:
        """The peers' effect; with ``hold_ms`` it first notes that it started, then waits."""
        if hold_ms:
            probe().set(f"{prefix}:probe:started:{order_id}", self.request.id)
            time.sleep(hold_ms / 1000)
        pipe = probe().pipeline(transaction=True)
        pipe.incr(f"{prefix}:effects:order.close_timeout:{order_id}")
        pipe.rpush(f"{prefix}:effects:log", f"py:{self.request.id}")
        pipe.execute()
        logger.info("order %s closed", order_id)
        return str(order_id)

    @app.task(name="test.fail", shared=False, bind=True, max_retries=2)
    def fail(self: Task, **payload: Any) -> None:
        raise TestFailure("test.fail always fails")

    @app.task(name="interop.stamp", shared=False, bind=True)
    def stamp(self: Task, **payload: Any) -> None:
        seconds, micros = probe().time()
        probe().hset(f"{prefix}:probe:stamp:{self.request.id}", mapping={
            "started_ms": int(seconds) * 1000 + int(micros) // 1000,
            "trace_id": self.request.trace_id or "",
        })
        logger.info("stamped %s", payload)

    return app


app = create_app()
