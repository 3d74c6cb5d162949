"""Why a task failed, as every language records it in a dead-letter entry (docs/protocol.md, 7).

:class:`FailureClass` names the failure classes, :class:`Failure` is what a
worker knows about one failure, and :func:`failure_fields` writes it as the
failure part of a dead-letter entry. Pure: the store writes the entries.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from kombu_envelope.envelope import format_rfc3339, utcnow

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
