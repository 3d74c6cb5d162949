"""Celery app of unchanged tasks, with Celery's defaults, on ``envelope://``.

No ``envelope_*`` setting and no product task option: these tasks must behave
as Celery documents. Only the key prefixes (isolating one test module's keys)
are set. Configured from the environment when loaded by a worker:
``TEST_BROKER_URL``, ``TEST_RESULT_BACKEND`` (its Redis also holds what the
tasks record, under ``<prefix>:probe:...``) and ``TEST_KEY_PREFIX``.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from typing import Any

import redis
from celery import Celery, Task
from celery.exceptions import Reject

import celery_ext  # noqa: F401  (envelope:// URLs)


class ExpectedError(Exception):
    """What the failing tasks raise."""


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or "redis://"
    prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")

    app = Celery("plain_app", broker=broker_url, backend=backend)
    app.conf.update(
        broker_transport_options={"key_prefix": prefix},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
    )

    @cache
    def probe() -> redis.Redis:
        return redis.Redis.from_url(backend)

    def record(task: Task, name: str) -> int:
        """Note the attempt's time, retries and headers; return how many attempts ran."""
        headers = task.request.headers or {}
        probe().rpush(f"{prefix}:probe:{name}", json.dumps({
            "at": time.time(), "retries": task.request.retries,
            "fast": headers.get("x-fast-retries"),
        }))
        return int(probe().llen(f"{prefix}:probe:{name}"))

    @app.task(name="plain.fail", shared=False, bind=True)
    def fail(self: Task, name: str) -> None:
        record(self, name)
        raise ExpectedError(f"{name} fails")

    @app.task(name="plain.disconnected", shared=False, bind=True)
    def disconnected(self: Task, name: str) -> None:
        """Raises an error the tiered policy calls transient."""
        record(self, name)
        raise ConnectionError(f"{name} cannot connect")

    @app.task(name="plain.add", shared=False, typing=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="plain.retry", shared=False, bind=True, max_retries=2)
    def retry(self: Task, name: str, countdown: float | None = None,
              succeed_at: int | None = None) -> int:
        """``self.retry(exc=...)`` until ``succeed_at`` retries (never by default)."""
        record(self, name)
        if succeed_at is not None and self.request.retries >= succeed_at:
            return int(self.request.retries)
        raise self.retry(exc=ExpectedError(f"{name} retried"), countdown=countdown)

    @app.task(name="plain.retry_default_delay", shared=False, bind=True, max_retries=1,
              default_retry_delay=1)
    def retry_default_delay(self: Task, name: str) -> int:
        """``self.retry()`` without exc or countdown: default_retry_delay, then no retries left."""
        record(self, name)
        raise self.retry()

    @app.task(name="plain.autoretry", shared=False, bind=True, max_retries=2,
              autoretry_for=(ExpectedError,), retry_backoff=1, retry_jitter=False)
    def autoretry(self: Task, name: str) -> None:
        record(self, name)
        raise ExpectedError(f"{name} is retried by autoretry_for")

    @app.task(name="plain.retry_once", shared=False, bind=True, max_retries=1)
    def retry_once(self: Task, expires: float | None = None) -> dict[str, Any]:
        """Celery's retry_once: retried once (keeps priority and headers), then returns them."""
        if self.request.retries:
            return {"retries": self.request.retries,
                    "priority": self.request.delivery_info.get("priority"),
                    "headers": self.request.headers or {}}
        raise self.retry(countdown=0.1, expires=expires, max_retries=1)

    @app.task(name="plain.retry_without_throw", shared=False, bind=True)
    def retry_without_throw(self: Task, name: str) -> int:
        """``self.retry(throw=False)`` publishes the retry and lets the attempt go on."""
        record(self, name)
        if not self.request.retries:
            self.retry(countdown=0.1, throw=False)
        return int(self.request.retries)

    @app.task(name="plain.reject_then_succeed", shared=False, bind=True, acks_late=True)
    def reject_then_succeed(self: Task) -> str:
        if not self.request.delivery_info.get("redelivered"):
            raise Reject(requeue=True)
        return "second-pass"

    @app.task(name="plain.sleep", shared=False)
    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    return app


app = create_app()
