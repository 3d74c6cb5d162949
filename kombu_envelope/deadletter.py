"""The dead-letter stream: where every terminal failure lands, with its raw bytes.

A dead-letter entry holds the failure fields below, then every field of the
original stream entry under ``raw.<field>``, byte for byte. Nothing is ever
dropped: a malformed entry is kept as it was written.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from kombu_envelope.envelope import format_rfc3339, utcnow
from kombu_envelope.scripts import script
from kombu_envelope.settings import Settings

#: Version of the dead-letter entry format.
DLQ_FORMAT_VERSION = "1"


class FailureClass(str, Enum):
    """Why a task ended in the dead-letter stream."""

    TRANSIENT_EXHAUSTED = "transient_exhausted"
    TASK_ERROR = "task_error"
    INVALID_PAYLOAD = "invalid_payload"
    TIMEOUT = "timeout"
    UNSUPPORTED_PAYLOAD_VERSION = "unsupported_payload_version"
    UNKNOWN_TASK_TYPE = "unknown_task_type"
    MALFORMED_ENTRY = "malformed_entry"
    REJECTED = "rejected"
    REDELIVERY_LIMIT = "redelivery_limit"


@dataclass(frozen=True)
class Failure:
    """What went wrong, as recorded in a dead-letter entry."""

    failure_class: FailureClass
    reason: str
    exception_type: str | None = None
    traceback: str | None = None
    attempts: int | None = None
    first_failure_at: datetime | None = None
    last_failure_at: datetime | None = None
    task_id: str | None = None
    task_type: str | None = None


def failure_fields(
    failure: Failure, *, queue: str, consumer: str, now: datetime | None = None
) -> dict[str, str]:
    """The failure part of a dead-letter entry (see docs/protocol.md)."""
    now = now or utcnow()
    fields = {
        "dlq": DLQ_FORMAT_VERSION,
        "failure_class": failure.failure_class.value,
        "reason": failure.reason,
        "queue": queue,
        "dead_at": format_rfc3339(now),
        "language": "python",
        "host": socket.gethostname(),
        "pid": str(os.getpid()),
        "consumer": consumer,
        "first_failure_at": format_rfc3339(failure.first_failure_at or now),
        "last_failure_at": format_rfc3339(failure.last_failure_at or now),
    }
    optional = {
        "exception_type": failure.exception_type,
        "traceback": failure.traceback,
        "attempts": None if failure.attempts is None else str(failure.attempts),
        "task_id": failure.task_id,
        "task_type": failure.task_type,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


def dead_letter_pending(
    client: Any,
    settings: Settings,
    *,
    queue: str,
    stream: str,
    entry_id: str,
    failure: Failure,
    consumer: str,
) -> str | None:
    """Move a pending entry to ``queue``'s dead-letter stream; ack and delete it.

    Returns the dead-letter entry id, or None when the entry was no longer pending.
    """
    fields = failure_fields(failure, queue=queue, consumer=consumer)
    args: list[Any] = [settings.consumer_group, entry_id]
    for name, value in fields.items():
        args += [name, value]
    reply = script(client, "dead_letter")(
        keys=[stream, settings.keys.queue(queue).dead], args=args
    )
    return reply.decode() if isinstance(reply, bytes) else reply or None
