"""What one outbox row holds, checked when it is written.

Shared by every writer (SQLAlchemy, Django): the Envelope is validated against the
publish-time rules and encoded once, in the caller's request, so that a task that
could never be published fails there and not later in the relay. The row keeps
the Envelope's canonical JSON; the relay parses it again before publishing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from kombu_envelope.codec import encode_body
from kombu_envelope.envelope import Envelope, check_publishable, utcnow
from kombu_envelope.settings import Settings
from kombu_envelope.trace_context import write_trace_headers

#: Name of the outbox table (SQLAlchemy and Django alike).
TABLE_NAME = "envelope_outbox"
#: Longest queue name and task id a row holds.
MAX_QUEUE_LENGTH = 255
MAX_TASK_ID_LENGTH = 255


@dataclass(frozen=True)
class OutboxValues:
    """The column values of one new outbox row (``id`` is the database's)."""

    queue: str
    task_id: str
    envelope: str
    created_at: datetime


def outbox_values(queue: str, envelope: Envelope, settings: Settings) -> OutboxValues:
    """Check that ``envelope`` may be published to ``queue`` and return its row.

    Raises :class:`~kombu_envelope.errors.InvalidEnvelope` (or ``ValueError`` for
    an invalid queue name) as :meth:`Publisher.publish` would. The current trace
    (``traceparent``) is written into the Envelope's headers now: the relay
    publishes outside the request's trace. Payload schemas live in Redis and are
    checked by the relay (a row that breaks one is dead-lettered there).
    """
    settings.keys.queue(queue)  # an invalid queue name fails here
    if len(queue) > MAX_QUEUE_LENGTH or len(envelope.task_id) > MAX_TASK_ID_LENGTH:
        raise ValueError(f"outbox rows hold queue names and task ids of at most "
                         f"{MAX_QUEUE_LENGTH} characters: queue {queue!r}, "
                         f"task_id {envelope.task_id!r}")
    write_trace_headers(envelope.headers)
    check_publishable(envelope, settings.limits)
    encode_body(envelope, None, limits=settings.limits)  # the size limit
    return OutboxValues(queue=queue, task_id=envelope.task_id,
                        envelope=envelope.to_json().decode(), created_at=utcnow())
