"""A transactional outbox: tasks stored in the caller's database transaction, then relayed.

A task written with :class:`OutboxWriter` (a SQLAlchemy ``Session`` or
``AsyncSession``) or the Django app (:mod:`kombu_envelope.outbox.django`) becomes a
row of the ``envelope_outbox`` table in the same transaction as the rest of the
request: committed together, or rolled back together. The :class:`Relay`
(``python -m kombu_envelope.outbox``, ``celery -A proj envelope outbox-relay``)
publishes committed rows and deletes them; a re-send after a crash is absorbed by
the publish token derived from the row (see :mod:`.relay`).

Inside :func:`divert_to`, tasks published through ``envelope://`` (kombu producers,
Celery's ``task.delay``) are written to the outbox instead. Needs the ``outbox``
extra (SQLAlchemy 2); :mod:`.context` alone does not.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["OutboxLag", "OutboxRow", "OutboxWriter", "Relay", "divert_to", "outbox_engine"]

_WHERE = {
    "OutboxLag": "lag", "OutboxRow": "table", "OutboxWriter": "writer", "Relay": "relay",
    "divert_to": "context", "outbox_engine": "relay",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that the channel's import of .context needs no SQLAlchemy.
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
