"""Task records: what became of each task (docs/protocol.md, section 14).

Every step of a task writes its record, the hash ``<prefix>:{<queue>}:task:<task_id>``
in its queue's slot, in the same script or ``MULTI`` that makes the step. A script
takes the record as its optional last KEY and the spec built by :func:`record_write`
as an ARGV; a ``MULTI`` adds the same write with :meth:`RecordWrite.add_to`.
With ``task_record_retention_s`` 0, :func:`record_write` answers an empty write and
the scripts run without a record.

:class:`TaskRecords` reads a record back with the section's reading rules.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from functools import lru_cache
from typing import Any

from pydantic_core import to_json

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope, parse_rfc3339, utcnow
from kombu_envelope.errors import InvalidQueueName, MalformedEntry
from kombu_envelope.failures import Failure
from kombu_envelope.keys import QueueKeys
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import Announcements
from kombu_envelope.store.replies import as_text

__all__ = ["RecordSpecs", "RecordWrite", "TaskRecord", "TaskRecords", "TaskState", "entry_record",
           "envelope_fields", "failure_error", "record_write", "skip_write"]

#: The least a record of a task not ended yet is kept after its last write (ms): 7 days.
OPEN_RECORD_MS = 7 * 24 * 3600 * 1000
#: Longest ``error`` field (characters).
MAX_ERROR_CHARS = 1_000

_COMPACT = json.JSONEncoder(separators=(",", ":"))


class TaskState(str, Enum):
    """The state of a task as a reader reports it."""

    SCHEDULED = "scheduled"
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def final(self) -> bool:
        """True for the states after which a task never runs again (without a replay)."""
        return self in _FINAL


_FINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.DEAD,
                    TaskState.CANCELLED})


@dataclass(frozen=True)
class RecordWrite:
    """The record write of one step: the script's extra KEY and spec ARGV, or nothing.

    Concatenate :attr:`keys` after a script's fixed KEYS and :attr:`args` right after
    its fixed ARGV; both are empty when records are off.
    """

    key: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    ttl_ms: int = 0
    dead_ttl_ms: int | None = None
    #: A start's write: ``HINCRBY attempts 1`` goes with it (in a ``MULTI``, not a script).
    counts_attempt: bool = False

    @property
    def keys(self) -> list[str]:
        """``[record key]``, or ``[]`` when records are off."""
        return [self.key] if self.key is not None else []

    @property
    def args(self) -> list[str | bytes]:
        """``[spec]`` (JSON ``{"ttl_ms", "fields"}``), or ``[]`` when records are off."""
        if self.key is None:
            return []
        spec: dict[str, Any] = {"ttl_ms": self.ttl_ms, "fields": self.fields}
        if self.dead_ttl_ms is not None:
            spec["dead_ttl_ms"] = self.dead_ttl_ms
        try:
            return [to_json(spec)]  # UTF-8, and several times faster than json
        except ValueError:  # a lone surrogate (in an error message): escaped by json
            return [_COMPACT.encode(spec)]

    def add_to(self, pipe: Any) -> int:
        """Add the write to ``pipe`` (a ``MULTI`` in the queue's slot): HSET, then
        ``HINCRBY attempts 1`` for a start, then PEXPIRE. Returns how many commands."""
        if self.key is None:
            return 0
        pipe.hset(self.key, mapping=self.fields)
        added = 1
        if self.counts_attempt:
            pipe.hincrby(self.key, "attempts", 1)
            added += 1
        if self.ttl_ms > 0:
            pipe.pexpire(self.key, self.ttl_ms)
            added += 1
        return added


def record_write(settings: Settings, queue: str, task_id: str, state: TaskState,
                 fields: Mapping[str, Any] | None = None, *, due_ms: int | None = None,
                 may_die: bool = False, now: datetime | None = None,
                 counts_attempt: bool = False) -> RecordWrite:
    """The record write of a step of ``task_id`` that leaves it in ``state``.

    ``fields`` are the step's other fields (datetimes become RFC 3339 in UTC with
    milliseconds, None is left out, ``error`` is cut to 1,000 characters);
    ``updated_at`` is added. ``due_ms`` (when the task is due next) makes a record of
    an open task last past that time.
    ``may_die``: the step (a takeover) may dead-letter instead, so the spec also
    carries ``dead_ttl_ms``. ``counts_attempt``: a start, written with
    ``HINCRBY attempts 1``. Returns an empty write when records are off.
    """
    retention_ms = settings.task_record_retention_s * 1000
    if retention_ms <= 0:
        return RecordWrite()
    now = now or utcnow()
    updated_at = _rfc3339_ms(now)
    values = {"state": state.value, "updated_at": updated_at}
    for name, value in (fields or {}).items():
        if value is None:
            continue
        if isinstance(value, datetime):
            text = updated_at if value is now else _rfc3339_ms(value)
        else:
            text = str(value)
        values[name] = text[:MAX_ERROR_CHARS] if name == "error" else text
    if state.final:
        ttl_ms = retention_ms
    else:
        ahead_ms = max(0, (due_ms or 0) - int(now.timestamp() * 1000))
        ttl_ms = max(OPEN_RECORD_MS, retention_ms) + ahead_ms
    return RecordWrite(settings.keys.queue(queue).task_record(task_id), values, ttl_ms,
                       retention_ms if may_die else None, counts_attempt)


class RecordSpecs:
    """The record writes of many steps taken at one moment ``now``, as script KEYS and ARGV.

    Steps whose record differs only by its task (one queue, state and set of fields,
    e.g. every task of one type published in one call) share one spec, built and
    encoded once; only the record key is the task's own.
    """

    def __init__(self, settings: Settings, now: datetime) -> None:
        self.settings = settings
        self.now = now
        self._specs: dict[tuple[Any, ...], list[str | bytes]] = {}

    def write(self, keys: QueueKeys, task_id: str, state: TaskState,
              shape: tuple[Any, ...], fields: Callable[[], Mapping[str, Any]], *,
              due_ms: int | None = None) -> tuple[list[str], list[str | bytes]]:
        """``(keys, args)`` of :func:`record_write` for the step (both empty when records
        are off).

        ``shape`` names what the step's fields depend on besides its queue and state;
        ``fields`` makes them, called once per shape, so a step whose spec is known builds
        none.
        """
        if self.settings.task_record_retention_s <= 0:
            return [], []
        key = (keys.queue, state, due_ms, *shape)
        args = self._specs.get(key)
        if args is None:
            args = self._specs[key] = record_write(
                self.settings, keys.queue, task_id, state, fields(), due_ms=due_ms,
                now=self.now).args
        return [keys.task_record(task_id)], args


def entry_record(client: Any, settings: Settings, queue: str, stream: str, entry_id: str,
                 state: TaskState, fields: Mapping[str, Any] | None = None, *,
                 task_id: str | None = None, may_die: bool = False) -> RecordWrite:
    """The record write of a step on a stream entry whose ``task_id`` the caller may not
    know: the entry is read first (``XRANGE``) to learn it. An entry that is gone or
    cannot be decoded gets no record."""
    if settings.task_record_retention_s <= 0:
        return RecordWrite()
    if task_id is None:
        found = client.xrange(stream, entry_id, entry_id)
        if not found:
            return RecordWrite()
        try:
            task_id = decode_entry(found[0][1], settings.limits).task_id
        except MalformedEntry:
            return RecordWrite()
    return record_write(settings, queue, task_id, state, fields, may_die=may_die)


def skip_write(settings: Settings, queue: str, task_id: str, reason: str) -> RecordWrite:
    """The record of a task acknowledged without running: ``reason`` ``cancelled`` or
    ``expired`` (state cancelled), or ``duplicate`` (state succeeded)."""
    state = TaskState.SUCCEEDED if reason == "duplicate" else TaskState.CANCELLED
    return record_write(settings, queue, task_id, state,
                        {"reason": reason, "finished_at": utcnow()})


def failure_error(failure: Failure) -> str:
    """The ``error`` field of a failure: ``"<exception type>: <reason>"``, or the failure
    class instead of the type when there is no exception."""
    return f"{failure.exception_type or failure.failure_class.value}: {failure.reason}"


def envelope_fields(envelope: Envelope, queue: str,
                    now: datetime | None = None) -> dict[str, Any]:
    """The fields a publish or replay writes from the Envelope (``due_at`` when ahead)."""
    fields: dict[str, Any] = {"task_type": envelope.task_type,
                              "payload_version": envelope.payload_version, "queue": queue,
                              "retry_count": envelope.retry_count}
    if not envelope.is_due(now):
        fields["due_at"] = envelope.schedule_time
    return fields


@dataclass(frozen=True)
class TaskRecord:
    """What a reader knows of a task (:meth:`TaskRecords.get`); ``raw`` is the hash."""

    task_id: str
    state: TaskState
    queue: str | None = None
    task_type: str | None = None
    payload_version: int | None = None
    published_at: datetime | None = None
    due_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime | None = None
    worker: str | None = None
    language: str | None = None
    host: str | None = None
    error: str | None = None
    dead_id: str | None = None
    reason: str | None = None
    attempts: int = 0
    retry_count: int = 0
    pid: int | None = None
    raw: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, task_id: str, state: TaskState, queue: str | None,
           raw: dict[str, str]) -> TaskRecord:
        """A record from its hash, reported in ``state``."""
        return cls(
            task_id=task_id, state=state, queue=raw.get("queue") or queue,
            task_type=raw.get("task_type"), payload_version=_int(raw.get("payload_version")),
            published_at=_time(raw.get("published_at")), due_at=_time(raw.get("due_at")),
            started_at=_time(raw.get("started_at")),
            finished_at=_time(raw.get("finished_at")),
            updated_at=_time(raw.get("updated_at")), worker=raw.get("worker"),
            language=raw.get("language"), host=raw.get("host"), error=raw.get("error"),
            dead_id=raw.get("dead_id"), reason=raw.get("reason"),
            attempts=_int(raw.get("attempts")) or 0,
            retry_count=_int(raw.get("retry_count")) or 0, pid=_int(raw.get("pid")),
            raw=raw)


class TaskRecords:
    """Reads task records, as the dispatcher's ``GET /tasks/{task_id}`` reports them."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()

    def record_key(self, queue: str, task_id: str) -> str:
        """The key of the record of ``task_id`` in ``queue``."""
        return self.settings.keys.queue(queue).task_record(task_id)

    def known_queues(self) -> list[str]:
        """Every queue a reader knows: the registries, and the queues of announced workers."""
        keys = self.settings.keys
        pipe = self.client.pipeline(transaction=False)
        for registry in (keys.queues, keys.dead_queues, keys.periodic_queues):
            pipe.smembers(registry)
        names = {as_text(name) for members in pipe.execute() for name in members}
        for worker in Announcements(self.client, self.settings).workers():
            names.update(worker.queues)
        return sorted(names)

    def get(self, task_id: str, queue: str | None = None) -> TaskRecord:
        """What became of ``task_id`` (looked for in ``queue``, or in every known queue).

        Reports the written state except where section 14 says otherwise: a due task
        no longer delayed reads ``queued``, a running task whose worker died ``queued``,
        a dead task whose dead-letter entry was purged ``failed``; without a record, a
        delayed task reads ``scheduled`` and any other ``unknown``.
        """
        queues = self._queue_keys([queue] if queue else self.known_queues())
        pipe = self.client.pipeline(transaction=False)
        for keys in queues:
            pipe.hgetall(keys.task_record(task_id))
            pipe.zscore(keys.delayed, task_id)
        replies = pipe.execute()
        found = [(keys, _text_hash(raw), delayed is not None)
                 for keys, raw, delayed in zip(queues, replies[::2], replies[1::2]) if raw]
        if not found:
            for keys, delayed in zip(queues, replies[1::2]):
                if delayed is not None:
                    return TaskRecord(task_id, TaskState.SCHEDULED, keys.queue)
            return TaskRecord(task_id, TaskState.UNKNOWN, queue)
        keys, raw, delayed = max(found, key=lambda item: item[1].get("updated_at", ""))
        return TaskRecord.of(task_id, self._state(keys, raw, delayed), keys.queue, raw)

    def _state(self, keys: QueueKeys, raw: dict[str, str], delayed: bool) -> TaskState:
        try:
            state = TaskState(raw.get("state", ""))
        except ValueError:
            return TaskState.UNKNOWN
        if state in (TaskState.SCHEDULED, TaskState.RETRYING):
            due = _time(raw.get("due_at"))
            if not delayed and (due is None or due <= utcnow()):
                return TaskState.QUEUED  # promoted
        elif state is TaskState.RUNNING:
            worker = raw.get("worker")
            if not worker or not self.client.exists(self.settings.keys.consumer(worker)):
                return TaskState.QUEUED  # its consumer died: the entry is taken over
        elif state is TaskState.DEAD:
            dead_id = raw.get("dead_id")
            if not dead_id or not self.client.xrange(keys.dead, dead_id, dead_id):
                return TaskState.FAILED  # purged
        return state

    def _queue_keys(self, names: list[str]) -> list[QueueKeys]:
        found = []
        for name in names:
            try:
                found.append(self.settings.keys.queue(name))
            except InvalidQueueName:  # listed by some other client
                continue
        return found


@lru_cache(maxsize=256)  # one publish_many formats its one "now" once
def _rfc3339_ms(value: datetime) -> str:
    """``value`` in UTC, RFC 3339 with milliseconds (``2026-01-02T03:04:05.678Z``)."""
    return value.astimezone(timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def _text_hash(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {as_text(name): as_text(value) for name, value in raw.items()}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _time(value: str | None) -> datetime | None:
    try:
        return parse_rfc3339(value) if value else None
    except ValueError:
        return None
