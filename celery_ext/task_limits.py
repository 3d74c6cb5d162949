"""Limits per task type from Celery settings (docs/protocol.md, section 19).

``envelope_task_limits`` maps task names to their limits, like ``task_annotations``::

    app.conf.envelope_task_limits = {
        "billing.charge": {"concurrency": 50},             # the downstream takes 50 calls
        "emails.send": {"rate": 10, "burst": 20},          # 10 starts/s, bursts of 20
    }

A worker checks the setting when it starts (a misspelt member stops it, naming the
member) and writes each limit to every queue it consumes, so the setting wins at each
start; ``celery envelope limits`` changes them at run time, for every worker of every
language at once, until a worker with the setting starts again.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.exceptions import ImproperlyConfigured

from celery_ext.broker import broker_redis, broker_settings, uses_envelope_broker
from kombu_envelope.errors import InvalidTaskLimit
from kombu_envelope.store.client import close_client
from kombu_envelope.store.task_limits import TaskLimit, TaskLimits, parse_limit

logger = logging.getLogger(__name__)

#: Celery setting: task name -> its limits (the members of protocol section 19).
LIMITS_SETTING = "envelope_task_limits"


def configured_limits(app: Any) -> dict[str, TaskLimit]:
    """The limits ``envelope_task_limits`` sets, checked; ImproperlyConfigured names the
    task and the member that breaks a rule."""
    configured = app.conf.get(LIMITS_SETTING) or {}
    if not isinstance(configured, dict):
        raise ImproperlyConfigured(f"{LIMITS_SETTING} must map task names to limits")
    limits = {}
    for task_type, value in configured.items():
        try:
            limits[task_type] = parse_limit(value)
        except InvalidTaskLimit as exc:
            raise ImproperlyConfigured(f"{LIMITS_SETTING}[{task_type!r}]: {exc}") from exc
    return limits


def consumed_queues(app: Any) -> list[str]:
    """The queues this worker consumes (``-Q``, else every queue the app declares)."""
    queues = app.amqp.queues
    selected = queues.consume_from or queues
    return sorted(selected) or [app.conf.task_default_queue]


class TaskLimitsStep(bootsteps.StartStopStep):
    """Worker bootstep: write ``envelope_task_limits`` to the consumed queues at start."""

    label = "Task limits"
    conditional = True

    def include_if(self, parent: Any) -> bool:
        return bool(parent.app.conf.get(LIMITS_SETTING)) and uses_envelope_broker(parent.app)

    def create(self, parent: Any) -> dict[str, TaskLimit]:
        return configured_limits(parent.app)  # raises before the worker starts

    def start(self, parent: Any) -> None:
        app = parent.app
        settings = broker_settings(app)
        client = broker_redis(app, settings)
        try:
            limits = TaskLimits(client, settings)
            for queue in consumed_queues(app):
                for task_type, limit in (self.obj or {}).items():
                    limits.set(queue, task_type, limit)
                    logger.info("limits of %s on queue %s: %s", task_type, queue,
                                limit.describe())
        except InvalidTaskLimit as exc:
            raise ImproperlyConfigured(f"{LIMITS_SETTING}: {exc}") from exc
        finally:
            close_client(client)
