"""Limits per task type (docs/protocol.md, section 19), and what a dead letter does to an
ordering key (section 20), from Celery settings.

``envelope_task_limits`` maps task names to their limits, like ``task_annotations``::

    app.conf.envelope_task_limits = {
        "billing.charge": {"concurrency": 50},             # the downstream takes 50 calls
        "emails.send": {"rate": 10, "burst": 20},          # 10 starts/s, bursts of 20
    }

A worker checks the setting when it starts (a misspelt member stops it, naming the
member) and writes each limit to every queue it consumes, so the setting wins at each
start; ``celery envelope limits`` changes them at run time, for every worker of every
language at once, until a worker with the setting starts again.

``envelope_ordering_on_dead_letter`` maps task names to ``"advance"`` (the default: a
dead-lettered head lets its key move on) or ``"halt"`` (the key waits for an operator)::

    app.conf.envelope_ordering_on_dead_letter = {"orders.pay": "halt"}

It is written the same way; ``celery envelope ordering policy`` changes it at run time.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.exceptions import ImproperlyConfigured

from celery_ext.broker import broker_redis, broker_settings, uses_envelope_broker
from kombu_envelope.errors import InvalidTaskLimit
from kombu_envelope.store.client import close_client
from kombu_envelope.store.ordering import OnDeadLetter, OrderingKeys
from kombu_envelope.store.task_limits import TaskLimit, TaskLimits, parse_limit

logger = logging.getLogger(__name__)

#: Celery setting: task name -> its limits (the members of protocol section 19).
LIMITS_SETTING = "envelope_task_limits"
#: Celery setting: task name -> "advance" or "halt" (protocol section 20).
ORDERING_SETTING = "envelope_ordering_on_dead_letter"


def configured_policies(app: Any) -> dict[str, OnDeadLetter]:
    """The policies ``envelope_ordering_on_dead_letter`` sets, checked; ImproperlyConfigured
    names the task whose value is neither ``advance`` nor ``halt``."""
    configured = app.conf.get(ORDERING_SETTING) or {}
    if not isinstance(configured, dict):
        raise ImproperlyConfigured(f"{ORDERING_SETTING} must map task names to "
                                   "'advance' or 'halt'")
    try:
        return {task_type: OnDeadLetter(value) for task_type, value in configured.items()}
    except ValueError as exc:
        raise ImproperlyConfigured(f"{ORDERING_SETTING}: {exc}; use 'advance' or 'halt'") from exc


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
    """Worker bootstep: write ``envelope_task_limits`` and ``envelope_ordering_on_dead_letter``
    to the consumed queues at start."""

    label = "Task limits"
    conditional = True

    def include_if(self, parent: Any) -> bool:
        conf = parent.app.conf
        return (bool(conf.get(LIMITS_SETTING) or conf.get(ORDERING_SETTING))
                and uses_envelope_broker(parent.app))

    def create(self, parent: Any) -> dict[str, TaskLimit]:
        # Both raise before the worker starts.
        self.policies = configured_policies(parent.app)
        return configured_limits(parent.app)

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
                for task_type, policy in self.policies.items():
                    OrderingKeys(client, settings).set_policy(queue, task_type, policy)
                    logger.info("a dead-lettered %s on queue %s makes its key %s", task_type,
                                queue, policy.value)
        except InvalidTaskLimit as exc:
            raise ImproperlyConfigured(f"{LIMITS_SETTING}: {exc}") from exc
        finally:
            close_client(client)
