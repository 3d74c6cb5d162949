"""Writing tasks into the outbox inside the caller's SQLAlchemy transaction."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from kombu_envelope.envelope import Envelope
from kombu_envelope.outbox.rows import outbox_values
from kombu_envelope.outbox.table import OutboxRow
from kombu_envelope.settings import Settings


class OutboxWriter:
    """Adds tasks to a ``Session`` or ``AsyncSession``: they are relayed once it commits.

    The row joins the session's transaction (one is begun if none is), so a
    rollback drops it with everything else::

        with Session(engine) as session, session.begin():
            session.add(order)
            OutboxWriter(session).write("orders", Envelope.new(task_type="order.placed",
                                                               payload={"id": 1}))

    :meth:`write` is synchronous for both kinds of session: the row is sent to the
    database with the session's next flush (at the latest its commit).
    """

    def __init__(self, session: Session | AsyncSession, settings: Settings | None = None
                 ) -> None:
        self.session = session
        self.settings = settings or Settings()

    def write(self, queue: str, envelope: Envelope) -> None:
        """Store ``envelope`` for ``queue``; raise InvalidEnvelope if it cannot be published."""
        self.session.add(OutboxRow.of(outbox_values(queue, envelope, self.settings)))
