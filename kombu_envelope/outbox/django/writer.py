"""Writing tasks into the outbox inside the current ``transaction.atomic`` block."""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, transaction

from kombu_envelope.envelope import Envelope
from kombu_envelope.outbox.rows import outbox_values
from kombu_envelope.settings import Settings


class NotInTransaction(RuntimeError):
    """A task was written to the outbox outside ``transaction.atomic``."""


class DjangoOutboxWriter:
    """Saves tasks as :class:`~kombu_envelope.outbox.django.models.OutboxEntry` rows of
    database ``using``: relayed once the enclosing atomic block commits."""

    def __init__(self, using: str = DEFAULT_DB_ALIAS, settings: Settings | None = None) -> None:
        self.using = using
        self.settings = settings or Settings()

    def in_transaction(self) -> bool:
        """True inside ``transaction.atomic`` on this writer's database."""
        return bool(transaction.get_connection(self.using).in_atomic_block)

    def write(self, queue: str, envelope: Envelope) -> None:
        """Store ``envelope`` for ``queue``; raise InvalidEnvelope if it cannot be published,
        :class:`NotInTransaction` outside an atomic block (the row would commit alone)."""
        if not self.in_transaction():
            raise NotInTransaction(
                f"the outbox is written inside transaction.atomic(using={self.using!r}), "
                "so that the task commits with the rest of the request")
        from kombu_envelope.outbox.django.models import OutboxEntry  # needs the app registry

        OutboxEntry.of(outbox_values(queue, envelope, self.settings)).save(using=self.using)
