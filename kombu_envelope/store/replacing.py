"""The next attempt of a task replaces its pending entry atomically (``retry.lua``).

A retry or a deferral of a task whose stream entry is still pending (its
consumer acknowledges after the task) must not be published beside it and
the old entry acknowledged afterwards: a crash in between would run the
attempt twice. Inside :func:`next_attempt_replaces`, which names the pending
entry, a :class:`~kombu_envelope.store.publisher.Publisher` that publishes the same
``task_id`` to the same queue runs ``retry.lua`` instead: the next attempt is
stored (in its stream, or in the delayed set when it is due later) and the
pending entry acknowledged and deleted in one step (docs/protocol.md,
sections 8 and 9). Every retry, automatic or explicit, and every deferral
goes through :func:`replace_pending`.

When the entry is no longer pending, it was taken over while its consumer
looked dead: its new owner runs it, so nothing is published (and that is
logged), unless the entry may have been acknowledged early
(``publish_if_gone``): then the next attempt is published as a new entry.
The later acknowledgement of a replaced entry finds nothing to do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kombu_envelope.codec import encode_body
from kombu_envelope.envelope import Envelope
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.task_records import TaskState, record_write

logger = logging.getLogger(__name__)


class Replaced(str, Enum):
    """What publishing the next attempt of a pending entry did."""

    #: The pending entry was replaced by the next attempt.
    REPLACED = "replaced"
    #: The entry was no longer pending (taken over): nothing was published.
    NOT_PENDING = "not_pending"


@dataclass
class PendingAttempt:
    """The stream entry of the attempt running now, pending under its consumer.

    ``publish_if_gone``: the entry may have been acknowledged before the task
    ended, so an entry found gone is not proof that it was taken over.
    ``outcome`` says what the publish of its next attempt did (None: none yet).
    ``retry_count`` is the running attempt's: a next attempt with a higher one is a
    retry (its record reads ``retrying``), else a deferral (``scheduled``); ``error``
    is the failure a retry follows, for the task record.
    """

    queue: str
    stream: str
    entry_id: str
    task_id: str
    publish_if_gone: bool = False
    outcome: Replaced | None = None
    retry_count: int = 0
    error: str | None = None


_pending: ContextVar[PendingAttempt | None] = ContextVar("envelope_pending_attempt",
                                                         default=None)


@contextmanager
def next_attempt_replaces(attempt: PendingAttempt) -> Iterator[PendingAttempt]:
    """Within the block, the next attempt of ``attempt.task_id`` replaces its entry."""
    token = _pending.set(attempt)
    try:
        yield attempt
    finally:
        _pending.reset(token)


def pending_replaced_by(queue: str, envelope: Envelope) -> PendingAttempt | None:
    """The pending entry a publish of ``envelope`` to ``queue`` replaces, if any.

    Only the first publish of the task's id replaces it: the entry is gone after.
    """
    attempt = _pending.get()
    if (attempt is None or attempt.outcome is not None or attempt.task_id != envelope.task_id
            or attempt.queue != queue):
        return None
    return attempt


def replace_pending(client: Any, settings: Settings, attempt: PendingAttempt,
                    envelope: Envelope) -> Replaced:
    """Replace ``attempt``'s pending entry by ``envelope`` with ``retry.lua``."""
    keys = settings.keys.queue(attempt.queue)
    bucket = bucket_for(envelope.priority)
    enc, body = encode_body(envelope, settings.gzip_min_bytes, limits=settings.limits)
    delayed = not envelope.is_due()
    retried = envelope.retry_count > attempt.retry_count
    record = record_write(
        settings, attempt.queue, envelope.task_id,
        TaskState.RETRYING if retried else TaskState.SCHEDULED,
        {"retry_count": envelope.retry_count,
         "due_at": envelope.schedule_time if delayed else None,
         "error": attempt.error if retried else None},
        due_ms=envelope.due_ms() if delayed else None)
    batch = Batch(client, settings, "retry")  # WAIT with wait_replicas
    if delayed:  # its own SADD, before retry.lua wakes promoters
        batch.first("sadd", settings.keys.queues, attempt.queue)
    batch.script("retry", [attempt.stream, keys.stream(bucket), keys.delayed, keys.delayed_data,
                           *record.keys],
                 [settings.consumer_group, attempt.entry_id, envelope.task_id,
                  envelope.due_ms() if delayed else 0, bucket.value, enc, body,
                  settings.keys.wakeup_channel, *record.args])
    replies = batch.execute()
    attempt.outcome = Replaced.REPLACED if replies[-1] else Replaced.NOT_PENDING
    if attempt.outcome is Replaced.NOT_PENDING and not attempt.publish_if_gone:
        logger.warning("task %s (%s): entry %s of %s is no longer pending (taken over); "
                       "its new owner runs it, so its next attempt is not published",
                       envelope.task_id, envelope.task_type, attempt.entry_id, attempt.stream)
    return attempt.outcome
