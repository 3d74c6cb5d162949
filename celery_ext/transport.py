"""The ``envelope://`` transport for Celery: every task message becomes an Envelope."""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.worker import state

from celery_ext.execution import runs_in_shell
from celery_ext.outbox import outbox_sink
from celery_ext.protocol import CeleryAdapter
from celery_ext.readiness import announced_concurrency, announced_tasks
from celery_ext.revoke import RevokingChannel
from kombu_envelope.kombu.transport import Transport as EnvelopeTransport
from kombu_envelope.outbox.context import OutboxSink


class Transport(EnvelopeTransport):
    """``envelope://`` with :class:`~celery_ext.protocol.CeleryAdapter` as default adapter.

    Its channels also cancel still-delayed tasks when Celery broadcasts a revoke
    (:mod:`celery_ext.revoke`).
    """

    Channel = RevokingChannel
    default_adapter = CeleryAdapter

    def keeps_running(self, message: Any) -> bool:
        """True while the worker runs the task of ``message`` (it was accepted by the pool).

        Celery keeps running such tasks when the broker connection breaks; their
        entries stay with their consumer, kept alive, until Celery acknowledges them.
        """
        return any(request.message is message for request in list(state.active_requests))

    def served_tasks(self) -> dict[str, list[int]]:
        """The worker's tasks (not ``celery.*``) and the payload versions each accepts."""
        return announced_tasks()

    def concurrency(self) -> int | None:
        """The worker's pool concurrency."""
        return announced_concurrency()

    def start_capacity(self) -> int | None:
        """The pool's free processes: its concurrency less the requests the worker holds
        (running, or waiting for a process)."""
        concurrency = announced_concurrency()
        return None if concurrency is None else max(0, concurrency - len(state.reserved_requests))

    def running_deliveries(self) -> list[dict[str, Any]]:
        """The delivery_info of the requests the worker holds (running, or waiting for a
        pool process), acknowledged early or not."""
        return [getattr(request.message, "delivery_info", None) or {}
                for request in list(state.reserved_requests)]

    def runner_frees_slots(self) -> bool:
        """True in a worker that runs tasks in the execution shell: the shell frees a
        task's slot when its run ends."""
        return runs_in_shell(current_app._get_current_object())

    def outbox_sink(self) -> OutboxSink | None:
        """An explicit ``divert_to``'s sink, else the outbox of the current app's
        ``envelope_outbox`` setting when in a transaction (:mod:`celery_ext.outbox`)."""
        return super().outbox_sink() or outbox_sink(current_app, self.settings)
