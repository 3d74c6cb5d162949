"""The ``envelope_outbox`` table as a SQLAlchemy mapping.

One row per task waiting to be relayed; ``id`` orders them. Rows are deleted
once relayed. Create the table with ``OutboxBase.metadata.create_all(engine)``
or add :data:`metadata` to your migrations (Alembic: ``target_metadata``); the
Django app (:mod:`kombu_envelope.outbox.django`) declares the same table.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Integer, MetaData, String, Table, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kombu_envelope.outbox.rows import (
    MAX_QUEUE_LENGTH,
    MAX_TASK_ID_LENGTH,
    TABLE_NAME,
    OutboxValues,
)


class OutboxBase(DeclarativeBase):
    """The declarative base of the outbox mapping (its own metadata)."""


class OutboxRow(OutboxBase):
    """One task stored in a transaction, waiting for the relay."""

    __tablename__ = TABLE_NAME

    # SQLite autoincrements only an INTEGER PRIMARY KEY (its rowid).
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    queue: Mapped[str] = mapped_column(String(MAX_QUEUE_LENGTH))
    task_id: Mapped[str] = mapped_column(String(MAX_TASK_ID_LENGTH))
    #: The Envelope's canonical JSON.
    envelope: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    @classmethod
    def of(cls, values: OutboxValues) -> OutboxRow:
        """A new row holding ``values``."""
        return cls(queue=values.queue, task_id=values.task_id, envelope=values.envelope,
                   created_at=values.created_at)


#: The metadata holding the outbox table.
metadata: MetaData = OutboxBase.metadata
#: The outbox table itself.
outbox_table: Table = metadata.tables[TABLE_NAME]
