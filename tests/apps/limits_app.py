"""Celery app of the limits per task type (docs/protocol.md, section 19), Celery's defaults.

``limits.task`` does what the Go, Node and Java peers' handler of the same name does: it
sleeps ``sleep_ms``, then records its span, ``RPUSH <prefix>:mx:spans`` of the JSON
``{"language": "py", "task_id", "start_ms", "end_ms"}`` (unix ms); ``limits.fast`` is the
same task under a type without limits. The matrix app registers ``limits.task`` too
(:mod:`apps.limits_tasks`).

Configured from the environment when loaded by a worker: ``TEST_BROKER_URL``
(``envelope://...``), ``TEST_RESULT_BACKEND`` (``redis://...``, whose Redis also holds the
spans), ``TEST_KEY_PREFIX``, ``TEST_LEASE_MS`` and ``TEST_TASK_LIMITS`` (JSON, the
``envelope_task_limits`` setting) and ``TEST_ORDERING_POLICY`` (JSON, the
``envelope_ordering_on_dead_letter`` setting). Celery's defaults otherwise: early
acknowledgement and a prefetch of four per process.
"""

from __future__ import annotations

import json
import os
from functools import cache

import redis
from celery import Celery

import celery_ext  # noqa: F401  (envelope:// URLs, the execution shell)
from apps.limits_tasks import add_limits_tasks


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None, lease_ms: int | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or "redis://"
    prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "30000"))

    app = Celery("limits_app", broker=broker_url, backend=backend)
    app.conf.update(
        broker_transport_options={"key_prefix": prefix, "lease_ms": lease_ms},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        broker_connection_retry_on_startup=True,
        envelope_task_limits=json.loads(os.environ.get("TEST_TASK_LIMITS") or "{}"),
        envelope_ordering_on_dead_letter=json.loads(os.environ.get("TEST_ORDERING_POLICY")
                                                    or "{}"),
    )

    @cache
    def records() -> redis.Redis:
        return redis.Redis.from_url(backend)

    add_limits_tasks(app, records, prefix)
    return app


app = create_app()
