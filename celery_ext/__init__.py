"""Celery on ``envelope://``: every Celery task is stored as an Envelope.

Enable it in the module that creates the Celery app::

    import celery_ext  # noqa: F401

    app = Celery("proj", broker="envelope://localhost:6379/0")

Importing this package makes ``envelope://`` and ``envelopes://`` URLs use
:class:`celery_ext.transport.Transport` and calls :func:`install`, which also
gives workers on ``envelope://`` the delayed-task promoter
(:mod:`celery_ext.bootsteps`), so ``countdown`` and ``eta`` need nothing else,
under ``celery worker`` and in Celery's test worker alike. Tasks
must use the JSON serializer (Celery's default) and task protocol 2 (the
default). The mapping is described in :mod:`celery_ext.protocol`, trace ids
and their log field in :mod:`celery_ext.tracing`.

Workers also run every task through the reliable-execution shell
(:mod:`celery_ext.execution`: idempotency keys, tiered retries for the tasks
that ask for them (:mod:`celery_ext.retry_policy`), time limits, dead
letters; otherwise tasks behave as Celery documents), run the app's
``beat_schedule`` in the shared scheduler (:mod:`celery_ext.periodic`), and a
revoke cancels tasks in Redis (:mod:`celery_ext.revoke`), and a ready worker
logs the queues and task types it serves (:mod:`celery_ext.readiness`).
"""

from __future__ import annotations

from celery import signals

from celery_ext.bootsteps import install_worker_steps
from celery_ext.execution import RECEIVERS as EXECUTION_RECEIVERS
from celery_ext.failures import InvalidPayload
from celery_ext.priority import mark_unset_priority
from celery_ext.protocol import CeleryAdapter, serve_worker_app
from celery_ext.readiness import announce_ready, remember_worker
from celery_ext.statistics import RECEIVERS as STATISTICS_RECEIVERS
from celery_ext.tracing import (
    TraceIdFilter,
    add_log_filter,
    current_trace_id,
    enter_task_trace,
    exit_task_trace,
    install_log_filter,
    propagate_trace_id,
    trace,
)
from kombu_envelope import register_transport

__all__ = [
    "CeleryAdapter",
    "InvalidPayload",
    "TraceIdFilter",
    "current_trace_id",
    "install",
    "install_log_filter",
    "trace",
]

#: kombu transport that ``envelope://`` URLs use once this package is imported.
TRANSPORT = "celery_ext.transport:Transport"

_RECEIVERS = (
    (signals.before_task_publish, mark_unset_priority),
    (signals.before_task_publish, propagate_trace_id),
    (signals.task_prerun, enter_task_trace),
    (signals.task_postrun, exit_task_trace),
    (signals.after_setup_logger, add_log_filter),
    (signals.after_setup_task_logger, add_log_filter),
    (signals.worker_init, serve_worker_app),
    (signals.worker_init, remember_worker),
    (signals.worker_init, install_worker_steps),
    (signals.worker_ready, announce_ready),
    *EXECUTION_RECEIVERS,
    *STATISTICS_RECEIVERS,
)


def install() -> None:
    """Register the transport aliases and connect the signal receivers (idempotent).

    The receivers are process-wide, like Celery's signals: they serve every app.
    """
    register_transport(TRANSPORT)
    for signal, receiver in _RECEIVERS:
        signal.connect(receiver, weak=False,
                       dispatch_uid=f"celery_ext.{receiver.__module__}.{receiver.__name__}")


install()
