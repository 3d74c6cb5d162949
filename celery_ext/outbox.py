"""Celery tasks published inside a database transaction go to the outbox.

Opt in with the app setting ``envelope_outbox``:

* ``"sqlalchemy"``: inside ``with outbox(session):`` a ``task.delay(...)`` becomes
  a row of ``session``'s transaction (:class:`~kombu_envelope.outbox.OutboxWriter`)::

      with Session(engine) as session, session.begin(), outbox(session):
          session.add(order)
          close_order.delay(order.id)

* ``"django"``: inside ``transaction.atomic()`` a ``task.delay(...)`` becomes a row
  of the atomic block (the ``kombu_envelope.outbox.django`` app must be installed).

Outside those blocks (and with the setting unset, when ``outbox(session)`` does
nothing) tasks are published as usual. The diversion happens where the
``envelope://`` channel turns the message into an Envelope
(:meth:`celery_ext.transport.Transport.outbox_sink`): the row holds exactly the
Envelope that would have been published, Celery's signals (``before_task_publish``,
``after_task_publish``) run as for any publish, and the result backend sees a
pending task. The next attempt of a running task (a retry) is never diverted.
The relay: ``celery -A proj envelope outbox-relay`` (:mod:`celery_ext.cli`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from kombu_envelope.outbox.context import OutboxSink
from kombu_envelope.settings import Settings

#: The Celery setting naming the outbox in use: "sqlalchemy", "django" or None.
SETTING = "envelope_outbox"
#: The Celery setting holding the relay's database URL (``outbox-relay --db`` wins).
DB_SETTING = "envelope_outbox_db"
MODES = ("sqlalchemy", "django")

_session: ContextVar[Any] = ContextVar("envelope_outbox_session", default=None)


@contextmanager
def outbox(session: Any) -> Iterator[None]:
    """With ``envelope_outbox = "sqlalchemy"``, write the tasks published inside to
    ``session`` (a SQLAlchemy ``Session`` or ``AsyncSession``)."""
    token = _session.set(session)
    try:
        yield
    finally:
        _session.reset(token)


def outbox_mode(app: Any) -> str | None:
    """The app's ``envelope_outbox`` setting, checked."""
    mode: str | None = app.conf.get(SETTING)
    if mode is not None and mode not in MODES:
        raise ValueError(f"{SETTING} = {mode!r}: must be one of {', '.join(map(repr, MODES))} "
                         "or None")
    return mode


def outbox_sink(app: Any, settings: Settings) -> OutboxSink | None:
    """Where the app's task published now goes instead of Redis, or None (Redis)."""
    mode = outbox_mode(app)
    if mode == "sqlalchemy":
        session = _session.get()
        if session is None:
            return None
        from kombu_envelope.outbox.writer import OutboxWriter

        return OutboxWriter(session, settings)
    if mode == "django":
        from kombu_envelope.outbox.django.writer import DjangoOutboxWriter

        writer = DjangoOutboxWriter(settings=settings)
        return writer if writer.in_transaction() else None
    return None
