"""Diverting the publishes of this context to an outbox.

Inside :func:`divert_to`, an ``envelope://`` channel that would publish a task
writes it to the given sink instead (see :meth:`Channel._put
<kombu_envelope.kombu.channel.Channel._put>`), so ``producer.publish`` and
Celery's ``task.delay`` keep working unchanged::

    with session.begin(), divert_to(OutboxWriter(session)):
        producer.publish(...)

The next attempt of the task being run (a retry or deferral, which replaces its
pending entry: :mod:`kombu_envelope.store.replacing`) is never diverted. Nothing
here needs SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from kombu_envelope.envelope import Envelope


class OutboxSink(Protocol):
    """Where diverted tasks go: an outbox writer bound to the caller's transaction."""

    def write(self, queue: str, envelope: Envelope) -> None:
        """Store ``envelope`` for ``queue`` in the transaction."""


_sink: ContextVar[OutboxSink | None] = ContextVar("envelope_outbox_sink", default=None)


@contextmanager
def divert_to(sink: OutboxSink) -> Iterator[OutboxSink]:
    """Write the tasks published in this context (thread, asyncio task) to ``sink``."""
    token = _sink.set(sink)
    try:
        yield sink
    finally:
        _sink.reset(token)


def current_sink() -> OutboxSink | None:
    """The sink of the enclosing :func:`divert_to`, if any."""
    return _sink.get()
