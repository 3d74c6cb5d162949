"""Run the delayed-task promoter inside every Celery worker on ``envelope://``.

Tasks published with a ``countdown`` or ``eta`` wait in their queue's delayed
set until a :class:`~kombu_envelope.scheduler.Promoter` moves them to their
stream. :class:`DelayedTaskPromoter` is a worker bootstep that runs one
promoter per worker process, so a deployment needs no separate scheduler
process: however many workers run, each due task is still delivered once.

The promoter runs in its own thread rather than on the worker's event loop.
With the ``solo`` pool, a task runs in the worker's main thread and blocks
that loop until it returns: a promoter driven by the loop would stop
promoting for as long as one long task runs, delaying every delayed task of
every queue and every worker that relies on it. In its thread it keeps
promoting on time whatever the pool is doing, and it only waits on Redis.

The step is included only when the app's broker transport is kombu-envelope's
(or a subclass such as :class:`celery_ext.transport.Transport`). Turn it off,
for example when ``python -m kombu_envelope.scheduler`` runs on its own, with::

    app.conf.envelope_promoter_enabled = False

The promoter also publishes the app's periodic tasks (``beat_schedule``, see
:mod:`celery_ext.periodic`) unless ``envelope_periodic_enabled = False``.

``celery_ext`` connects :func:`install_worker_steps` to
:data:`celery.signals.worker_init`, which every ``WorkController`` sends
before it builds its blueprint: the ``celery worker`` command and Celery's
test worker (``celery.contrib.testing.worker.start_worker``, the
``celery_worker`` pytest fixture) alike. The app's worker steps are a set, so
a worker runs one promoter however often the step is added
(:func:`add_worker_steps` does it by hand).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from celery_ext.broker import broker_redis, broker_settings, uses_envelope_broker
from celery_ext.periodic import periodic_scheduler
from celery_ext.task_limits import TaskLimitsStep
from kombu_envelope.store.client import AnyRedis, close_client
from kombu_envelope.store.promoter import Promoter

__all__ = [
    "ENABLED_SETTING",
    "DelayedTaskPromoter",
    "add_worker_steps",
    "install_worker_steps",
]

logger = logging.getLogger(__name__)

#: Celery setting that keeps the promoter out of the worker when False (default True).
ENABLED_SETTING = "envelope_promoter_enabled"


class DelayedTaskPromoter(bootsteps.StartStopStep):
    """Worker bootstep: a :class:`Promoter` thread from worker start to worker stop.

    The promoter also runs the app's periodic tasks (:mod:`celery_ext.periodic`).
    """

    label = "Delayed-task promoter"
    conditional = True
    # Start after the pool has forked its processes, so they do not inherit the thread.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.client: AnyRedis | None = None

    def include_if(self, parent: Any) -> bool:
        app = parent.app
        if not app.conf.get(ENABLED_SETTING, True):
            logger.debug("delayed-task promoter disabled by %s", ENABLED_SETTING)
            return False
        return uses_envelope_broker(app)

    def create(self, parent: Any) -> Promoter:
        app = parent.app
        settings = broker_settings(app)
        client = self.client = broker_redis(app, settings)
        periodic = periodic_scheduler(app, client, settings)
        return Promoter(lambda: client, settings,
                        jobs=[periodic] if periodic is not None else [])

    def start(self, parent: Any) -> None:
        if self.obj is not None:
            self.obj.start()
            logger.debug("delayed-task promoter started (key prefix %r)",
                         self.obj.settings.key_prefix)

    def stop(self, parent: Any) -> None:
        if self.obj is not None:
            self.obj.stop()
        if self.client is not None:
            close_client(self.client)

    def terminate(self, parent: Any) -> None:
        self.stop(parent)


def add_worker_steps(app: Any) -> None:
    """Add :class:`DelayedTaskPromoter` and the task limits step
    (:mod:`celery_ext.task_limits`) to the app's worker blueprint (idempotent)."""
    app.steps["worker"].add(DelayedTaskPromoter)
    app.steps["worker"].add(TaskLimitsStep)


def install_worker_steps(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: add the worker steps before the worker builds its blueprint.

    ``sender`` is the worker (any ``WorkController``, test workers included).
    """
    app = getattr(sender, "app", None)
    if app is not None:
        add_worker_steps(app)
