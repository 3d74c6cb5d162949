"""Inspect delayed tasks, and cancel tasks (docs/protocol.md, section 10).

Delayed tasks wait in ``<prefix>:{<queue>}:delayed`` (task ids scored by due
time) with their stored entries in ``<prefix>:{<queue>}:delayed:data``.
Cancelling marks the task id in ``<prefix>:cancelled``, one sorted set for
every queue, and then removes the task from the delayed set it may wait in:
consumers skip a marked task wherever it arrives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from kombu_envelope.codec import decode_body
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.errors import InvalidQueueName, MalformedEntry
from kombu_envelope.keys import QueueKeys
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.task_records import TaskState, record_write

#: How long a cancel mark is kept (ms): 7 days.
CANCEL_MARK_RETENTION_MS = 7 * 24 * 3600 * 1000


class CancelOutcome(str, Enum):
    """What cancelling a task did. Every outcome leaves the task marked cancelled."""

    #: The task was still delayed and is gone from its delayed set.
    REMOVED = "removed"
    #: The task was not delayed; it may be in a stream, where consumers skip it.
    MARKED = "marked"
    #: It had been marked before (and was not delayed).
    ALREADY = "already"


@dataclass(frozen=True)
class Cancellation:
    """The outcome of cancelling a task, and the queue it was removed from (if any)."""

    outcome: CancelOutcome
    queue: str | None = None


@dataclass(frozen=True)
class DelayedTask:
    """One delayed task: where it waits, when it is due, and its Envelope."""

    queue: str
    task_id: str
    due: datetime
    envelope: Envelope | None
    error: str | None = None


def _decode_stored(stored: bytes, settings: Settings) -> tuple[Envelope | None, str | None]:
    """Decode a delayed-set value "<bucket>\\n<enc>\\n<body>"."""
    try:
        _bucket, enc, body = stored.split(b"\n", 2)
        return decode_body(enc, body, settings.limits), None
    except ValueError:
        return None, "stored value has no bucket/enc header"
    except MalformedEntry as exc:
        return None, exc.reason


class DelayedTasks:
    """Read-only views of the delayed sets, and cancelling tasks."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()

    def queues(self) -> list[str]:
        """Queues that have (or had) delayed tasks."""
        return sorted(as_text(q) for q in self.client.smembers(self.settings.keys.queues))

    def count(self, queue: str) -> int:
        """How many tasks of ``queue`` are delayed."""
        return int(self.client.zcard(self.settings.keys.queue(queue).delayed))

    def counts(self) -> dict[str, int]:
        """Delayed tasks per queue."""
        return {queue: self.count(queue) for queue in self.queues()}

    def next_due(self, queue: str, limit: int = 10) -> list[DelayedTask]:
        """The ``limit`` tasks of ``queue`` due soonest."""
        keys = self.settings.keys.queue(queue)
        scored = self.client.zrange(keys.delayed, 0, limit - 1, withscores=True)
        return self._with_envelopes(queue, scored)

    def iter_all(self, queue: str, batch: int = 500) -> Iterator[DelayedTask]:
        """Every delayed task of ``queue``, soonest first."""
        keys = self.settings.keys.queue(queue)
        start = 0
        while True:
            scored = self.client.zrange(keys.delayed, start, start + batch - 1, withscores=True)
            if not scored:
                return
            yield from self._with_envelopes(queue, scored)
            start += batch

    def count_by_task_type(self, queue: str) -> Counter[str]:
        """Delayed tasks of ``queue`` per ``task_type`` (undecodable ones under "?")."""
        return Counter(
            task.envelope.task_type if task.envelope else "?" for task in self.iter_all(queue)
        )

    def get(self, task_id: str, queue: str | None = None) -> DelayedTask | None:
        """Look a delayed task up by ``task_id`` (in ``queue``, or in every queue)."""
        for name in [queue] if queue else self.queues():
            keys = self.settings.keys.queue(name)
            score = self.client.zscore(keys.delayed, task_id)
            if score is not None:
                return self._with_envelopes(name, [(task_id, score)])[0]
        return None

    def cancel(self, task_id: str, queue: str) -> CancelOutcome:
        """Cancel ``task_id``, looking for it in the delayed set of ``queue`` only."""
        return self._cancel(task_id, [self.settings.keys.queue(queue)]).outcome

    def cancel_everywhere(self, task_id: str) -> Cancellation:
        """Cancel ``task_id`` without knowing its queue: removed from whichever
        delayed set holds it (every queue in ``<prefix>:queues`` is looked at)."""
        keys = []
        for queue in self.queues():
            try:
                keys.append(self.settings.keys.queue(queue))
            except InvalidQueueName:  # written by some other client
                continue
        return self._cancel(task_id, keys)

    def _cancel(self, task_id: str, queues: list[QueueKeys]) -> Cancellation:
        """Mark ``task_id`` first and always, then remove it from the delayed sets."""
        cancelled = self.settings.keys.cancelled
        now_ms = int(utcnow().timestamp() * 1000)
        mark = self.client.pipeline(transaction=True)
        mark.zremrangebyscore(cancelled, "-inf", now_ms - CANCEL_MARK_RETENTION_MS)
        mark.zadd(cancelled, {task_id: now_ms}, nx=True)
        newly_marked = mark.execute()[1]
        if queues:
            batch = Batch(self.client)  # one cancel.lua per queue, each in its slot
            for keys in queues:
                # Written by the script only where the task was delayed.
                record = record_write(self.settings, keys.queue, task_id, TaskState.CANCELLED,
                                      {"reason": "cancelled", "finished_at": utcnow()})
                batch.script("cancel", [keys.delayed, keys.delayed_data, *record.keys],
                             [task_id, *record.args])
            for keys, reply in zip(queues, batch.execute()):
                if as_text(reply) == CancelOutcome.REMOVED.value:
                    return Cancellation(CancelOutcome.REMOVED, keys.queue)
        return Cancellation(CancelOutcome.MARKED if newly_marked else CancelOutcome.ALREADY)

    def _with_envelopes(self, queue: str, scored: list[tuple[Any, float]]) -> list[DelayedTask]:
        if not scored:
            return []
        keys = self.settings.keys.queue(queue)
        ids = [as_text(member) for member, _ in scored]
        stored = self.client.hmget(keys.delayed_data, ids)
        tasks = []
        for task_id, (_, score), value in zip(ids, scored, stored):
            envelope, error = (None, "no stored entry") if value is None else _decode_stored(
                value, self.settings)
            due = datetime.fromtimestamp(score / 1000, tz=timezone.utc)
            tasks.append(DelayedTask(queue, task_id, due, envelope, error))
        return tasks
