"""The outbox row as a Django model (the table :mod:`kombu_envelope.outbox.table` maps)."""

from __future__ import annotations

from django.db import models

from kombu_envelope.outbox.rows import (
    MAX_QUEUE_LENGTH,
    MAX_TASK_ID_LENGTH,
    TABLE_NAME,
    OutboxValues,
)


class OutboxEntry(models.Model):
    """One task stored in a transaction, waiting for the relay."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=MAX_QUEUE_LENGTH)
    task_id = models.CharField(max_length=MAX_TASK_ID_LENGTH)
    #: The Envelope's canonical JSON.
    envelope = models.TextField()
    created_at = models.DateTimeField()

    class Meta:
        db_table = TABLE_NAME
        ordering = ["id"]

    @classmethod
    def of(cls, values: OutboxValues) -> OutboxEntry:
        """A new (unsaved) row holding ``values``."""
        return cls(queue=values.queue, task_id=values.task_id, envelope=values.envelope,
                   created_at=values.created_at)
