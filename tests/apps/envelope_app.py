"""Celery app for worker tests; the same module runs on ``envelope://`` and ``redis://``.

Configured from the environment when loaded by a worker:

* ``TEST_BROKER_URL`` - broker URL, ``envelope://...`` or ``redis://...``.
* ``TEST_RESULT_BACKEND`` - result backend URL (``redis://...``); its Redis
  also holds the counters of :func:`flaky`.
* ``TEST_KEY_PREFIX`` - key prefix isolating one test's keys (broker and results).
* ``TEST_LEASE_MS`` - consumer lease of the ``envelope://`` transport.

Worker log lines show the trace id (``[trace_id=...]``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject
from celery.utils.log import get_task_logger

import celery_ext  # noqa: F401  (envelope:// URLs, trace ids)

#: Log formats with the trace id of the task being logged.
LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] [trace_id=%(trace_id)s] %(message)s"
TASK_LOG_FORMAT = (
    "[%(asctime)s: %(levelname)s/%(processName)s] %(task_name)s[%(task_id)s] "
    "[trace_id=%(trace_id)s] %(message)s"
)

logger = get_task_logger(__name__)


def create_app(
    broker_url: str | None = None,
    result_backend: str | None = None,
    key_prefix: str | None = None,
    lease_ms: int | None = None,
) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    result_backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or None
    key_prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "30000"))

    app = Celery("envelope_app", broker=broker_url, backend=result_backend)
    # envelope:// refuses the options of redis:// (global_keyprefix is its key_prefix).
    stock = broker_url.startswith(("redis://", "rediss://"))
    broker_options: dict[str, object] = (
        {"global_keyprefix": f"{key_prefix}:"} if stock
        else {"key_prefix": key_prefix, "lease_ms": lease_ms})
    app.conf.update(
        broker_transport_options=broker_options,
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:"},
        broker_connection_retry_on_startup=True,
        result_expires=600,
        worker_log_format=LOG_FORMAT,
        worker_task_log_format=TASK_LOG_FORMAT,
    )

    def counter() -> redis.Redis:
        return redis.Redis.from_url(result_backend or "redis://")

    @app.task(name="envelope_app.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="envelope_app.tsum", shared=False)
    def tsum(numbers: list[int]) -> int:
        return sum(numbers)

    @app.task(name="envelope_app.collect", shared=False)
    def collect(first: Any, *rest: Any, **options: Any) -> list[Any]:
        return [first, list(rest), options]

    @app.task(name="order.close_timeout", shared=False, bind=True)
    def close_timeout(self: Task, order_id: int) -> dict[str, Any]:
        return {"closed": order_id, "retries": self.request.retries,
                "trace_id": self.request.trace_id}

    @app.task(name="envelope_app.v2_only", shared=False, payload_versions=(2,))
    def v2_only(**payload: Any) -> dict[str, Any]:
        return payload

    @app.task(name="envelope_app.sleep", shared=False)
    def sleep(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @app.task(name="envelope_app.flaky", shared=False, bind=True, max_retries=5)
    def flaky(self: Task, key: str, failures: int, countdown: float = 0) -> int:
        """Fail ``failures`` times (counted in Redis under the prefix), then succeed."""
        attempt = int(counter().incr(f"{key_prefix}:flaky:{key}"))
        if attempt <= failures:
            raise self.retry(countdown=countdown)
        return attempt

    @app.task(name="envelope_app.reject_once", shared=False, bind=True, acks_late=True)
    def reject_once(self: Task) -> str:
        """Reject with requeue on the first delivery; succeed when redelivered."""
        if not self.request.delivery_info.get("redelivered"):
            raise Reject("first delivery", requeue=True)
        return "redelivered"

    @app.task(name="envelope_app.log_trace", shared=False, bind=True)
    def log_trace(self: Task, note: str) -> str | None:
        logger.warning("logging %s", note)
        trace_id: str | None = self.request.trace_id
        return trace_id

    return app


app = create_app()
