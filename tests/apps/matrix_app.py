"""Celery app of the cross-language matrix (``tests/test_matrix.py``).

``matrix.task`` does what the Go, Node and Java peers' handler of the same name does
(``tests/interop/go/matrix.go``): it records the attempt in
``<prefix>:mx:attempts:<task_id>`` (``py:<retries>``) and the trace headers it came with in
``<prefix>:mx:trace:<task_id>`` (the JSON ``{"language", "traceparent", "tracestate",
"trace_id"}``); with ``hold_ms`` it records ``<prefix>:mx:started:<task_id>`` and waits; it
fails with :class:`MatrixFailure` while ``fail`` is true or for the first ``fail_times``
attempts (with ``log``, each attempt first records ``start <task_id>`` in
``<prefix>:mx:log:<log>``, and a success ``end <task_id>`` before its effect); otherwise it
records its effect in ``<prefix>:mx:effect:<task_id>``
(``py:<unix ms>``), publishes each task of ``then`` (``{"queue", "task_id", "then"}``) as a
``matrix.task`` whose payload's ``then`` is the nested one, with the app's ``send_task`` from
inside the task (so it continues the running task's trace), and returns
``{"language": "py"}``. ``limits.task`` is the limits' handler (:mod:`apps.limits_app`).

Configured from the environment when loaded by a worker: ``TEST_BROKER_URL``
(``envelope://...``), ``TEST_RESULT_BACKEND`` (``redis://...``, whose Redis also holds the
records), ``TEST_KEY_PREFIX`` and ``TEST_LEASE_MS``. Celery's defaults otherwise, except
late acknowledgement with a prefetch of one (so that a worker killed mid-task leaves the
task to another) and the short retry delays every matrix worker uses; ``matrix.task``
retries automatically only when its Envelope asks (``x-retry-policy: tiered``).
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from typing import Any

import redis
from celery import Celery, Task

import celery_ext  # noqa: F401  (envelope:// URLs, trace ids, the execution shell)
from apps.limits_tasks import add_limits_tasks
from celery_ext.failures import InvalidPayload
from kombu_envelope.trace_context import TRACE_HEADERS

#: The retry delays of every matrix worker (the peers are started with the same).
RETRY_POLICY = {"fast_retries": 2, "backoff_s": 0.2, "max_backoff_s": 1.0}


class MatrixFailure(Exception):
    """The error of a matrix task asked to fail: not transient."""


def next_tasks(value: Any, name: str = "then") -> list[dict[str, Any]]:
    """The tasks of ``payload.then`` (``None``: none), each checked; else InvalidPayload."""
    if value is None:
        return []
    rule = (f'payload.{name} must be a list of {{"queue": non-empty string, '
            f'"task_id": non-empty string, "then": list}}')
    if not isinstance(value, list):
        raise InvalidPayload(rule)
    for index, task in enumerate(value):
        if not (isinstance(task, dict) and isinstance(task.get("queue"), str) and task["queue"]
                and isinstance(task.get("task_id"), str) and task["task_id"]):
            raise InvalidPayload(rule)
        next_tasks(task.get("then"), f"{name}[{index}].then")
    return value


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
                    then: Any = None, log: str | None = None,
                    **payload: Any) -> dict[str, str]:
        """The matrix handler (see the module's doc)."""
        task_id = self.request.id
        chain = next_tasks(then)
        attempt = records().rpush(f"{prefix}:mx:attempts:{task_id}", f"py:{self.request.retries}")
        seen = {"language": "py", "trace_id": getattr(self.request, "trace_id", None),
                **{name: getattr(self.request, name, None) for name in TRACE_HEADERS}}
        records().rpush(f"{prefix}:mx:trace:{task_id}", json.dumps(seen))
        if log is not None:
            records().rpush(f"{prefix}:mx:log:{log}", f"start {task_id}")
        if hold_ms:
            records().rpush(f"{prefix}:mx:started:{task_id}", "py")
            time.sleep(hold_ms / 1000)
        if fail or attempt <= fail_times:
            raise MatrixFailure(f"matrix.task failed attempt {attempt}")
        if log is not None:
            records().rpush(f"{prefix}:mx:log:{log}", f"end {task_id}")
        records().rpush(f"{prefix}:mx:effect:{task_id}", f"py:{int(time.time() * 1000)}")
        for task in chain:
            app.send_task("matrix.task", kwargs={"then": task.get("then") or []},
                          queue=task["queue"], task_id=task["task_id"])
        return {"language": "py"}

    add_limits_tasks(app, records, prefix)
    return app


app = create_app()
