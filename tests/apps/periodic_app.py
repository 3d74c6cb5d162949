"""Celery app with a ``beat_schedule``, for periodic-task tests (``celery -A apps.periodic_app``).

Configured from the environment when loaded by a worker or ``celery envelope``:

* ``TEST_BROKER_URL`` - ``envelope://...`` broker URL.
* ``TEST_REDIS_URL`` - Redis where :func:`record` appends what ran.
* ``TEST_KEY_PREFIX`` - key prefix of the broker (and of the records).
* ``TEST_BEAT_SCHEDULE`` - JSON ``{name: {"every": seconds, "args": [...], "kwargs": {...},
  "options": {...}, "task": "..."}}``; ``"cron": "m h dom mon dow"`` instead of
  ``every`` gives a crontab; ``task`` defaults to :func:`record`.
* ``TEST_PERIODIC_ENABLED`` - ``envelope_periodic_enabled``: ``1``, ``0`` or unset.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery, Task
from celery.schedules import crontab

import celery_ext  # noqa: F401  (envelope:// URLs)

#: Name of the task that records its runs.
RECORD = "periodic_app.record"


def runs_key(key_prefix: str) -> str:
    """Redis list of ``"<tag> <task_id>"``, one item per run of :func:`record`."""
    return f"{key_prefix}:runs"


def beat_schedule(spec: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A Celery ``beat_schedule`` from the compact JSON form described above."""
    schedule = {}
    for name, entry in spec.items():
        when: Any = (crontab(*entry["cron"].split()) if "cron" in entry
                     else float(entry["every"]))
        schedule[name] = {"task": entry.get("task", RECORD), "schedule": when,
                          "args": entry.get("args", [name]), "kwargs": entry.get("kwargs", {}),
                          "options": entry.get("options", {})}
    return schedule


def create_app(broker_url: str | None = None, redis_url: str | None = None,
               key_prefix: str | None = None,
               schedule: dict[str, dict[str, Any]] | None = None,
               periodic_enabled: bool | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    redis_url = redis_url or os.environ.get("TEST_REDIS_URL", "redis://")
    key_prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    if schedule is None:
        schedule = json.loads(os.environ.get("TEST_BEAT_SCHEDULE", "{}"))
    if periodic_enabled is None and os.environ.get("TEST_PERIODIC_ENABLED"):
        periodic_enabled = os.environ["TEST_PERIODIC_ENABLED"] == "1"

    app = Celery("periodic_app", broker=broker_url)
    app.conf.update(
        broker_transport_options={"key_prefix": key_prefix},
        broker_connection_retry_on_startup=True,
        beat_schedule=beat_schedule(schedule),
        task_ignore_result=True,
    )
    if periodic_enabled is not None:
        app.conf.envelope_periodic_enabled = periodic_enabled

    @app.task(name=RECORD, shared=False, bind=True)
    def record(self: Task, tag: str) -> None:
        """Append ``"<tag> <task_id>"`` to the runs list."""
        client = redis.Redis.from_url(redis_url)
        try:
            client.rpush(runs_key(key_prefix), f"{tag} {self.request.id}")
        finally:
            client.close()

    return app


app = create_app()
