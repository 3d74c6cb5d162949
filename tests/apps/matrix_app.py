"""Celery app of the cross-language matrix (``tests/test_matrix.py``).

``matrix.task`` does what the Go, Node and Java peers' handler of the same name does
(``tests/interop/go/matrix.go``): it records the attempt in
``<prefix>:mx:attempts:<task_id>`` (``py:<retries>``); with ``hold_ms`` it records
``<prefix>:mx:started:<task_id>`` and waits; it fails with :class:`MatrixFailure` while
``fail`` is true or for the first ``fail_times`` attempts; otherwise it records its effect
in ``<prefix>:mx:effect:<task_id>`` (``py:<unix ms>``) and returns ``{"language": "py"}``.

Configured from the environment when loaded by a worker: ``TEST_BROKER_URL``
(``envelope://...``), ``TEST_RESULT_BACKEND`` (``redis://...``, whose Redis also holds the
records), ``TEST_KEY_PREFIX`` and ``TEST_LEASE_MS``. Celery's defaults otherwise, except
late acknowledgement with a prefetch of one (so that a worker killed mid-task leaves the
task to another) and the short retry delays every matrix worker uses; ``matrix.task``
retries automatically only when its Envelope asks (``x-retry-policy: tiered``).
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import Any

import redis
from celery import Celery, Task

import celery_ext  # noqa: F401  (envelope:// URLs, trace ids, the execution shell)

#: The retry delays of every matrix worker (the peers are started with the same).
RETRY_POLICY = {"fast_retries": 2, "backoff_s": 0.2, "max_backoff_s": 1.0}


class MatrixFailure(Exception):
    """The error of a matrix task asked to fail: not transient."""


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None, lease_ms: int | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or "redis://"
    prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "3000"))

    app = Celery("matrix_app", broker=broker_url, backend=backend)
    app.conf.update(
        broker_transport_options={"key_prefix": prefix, "lease_ms": lease_ms},
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        envelope_retry_policy=RETRY_POLICY,
        envelope_idempotency_defer=0.3,
    )

    @cache
    def records() -> redis.Redis:
        return redis.Redis.from_url(backend)

    # Retries only when the Envelope asks (x-retry-policy: tiered), as in every language.
    @app.task(name="matrix.task", shared=False, bind=True, envelope_retry_policy=False)
    def matrix_task(self: Task, hold_ms: int = 0, fail_times: int = 0, fail: bool = False,
                    **payload: Any) -> dict[str, str]:
        """The matrix handler (see the module's doc)."""
        task_id = self.request.id
        attempt = records().rpush(f"{prefix}:mx:attempts:{task_id}", f"py:{self.request.retries}")
        if hold_ms:
            records().rpush(f"{prefix}:mx:started:{task_id}", "py")
            time.sleep(hold_ms / 1000)
        if fail or attempt <= fail_times:
            raise MatrixFailure(f"matrix.task failed attempt {attempt}")
        records().rpush(f"{prefix}:mx:effect:{task_id}", f"py:{int(time.time() * 1000)}")
        return {"language": "py"}

    return app


app = create_app()
