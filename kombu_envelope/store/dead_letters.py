"""The dead-letter stream: where every terminal failure lands, with its raw bytes.

A dead-letter entry holds the failure fields (see docs/protocol.md), then every
field of the original stream entry under ``raw.<field>``, byte for byte.
Nothing is ever dropped: a malformed entry is kept as it was written.

:class:`DeadLetters` lists, shows, counts, purges and replays entries.
"""

from __future__ import annotations

import base64
import getpass
import json
import socket
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, cast

from kombu_envelope.codec import decode_entry, encode_body, encode_entry
from kombu_envelope.envelope import Envelope, Limits, check_publishable, format_rfc3339, utcnow
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.failures import Failure, failure_fields
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store.replication import execute, run_script, write_pipeline
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.schemas import PayloadSchemas
from kombu_envelope.store.scripts import script
from kombu_envelope.store.task_records import (
    RecordWrite,
    TaskState,
    entry_record,
    envelope_fields,
    failure_error,
    record_write,
)


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
    record = entry_record(client, settings, queue, stream, entry_id, TaskState.DEAD,
                          _dead_record_fields(failure), task_id=failure.task_id)
    args: list[Any] = [settings.consumer_group, entry_id, *record.args]
    for name, value in fields.items():
        args += [name, value]
    client.sadd(settings.keys.dead_queues, queue)  # first, on its own (section 2)
    reply = run_script(client, settings, "dead_letter",
                       [stream, settings.keys.queue(queue).dead, *record.keys],
                       args, "dead letter")
    return as_text(reply) if reply else None


def _dead_record_fields(failure: Failure) -> dict[str, Any]:
    return {"finished_at": utcnow(), "error": failure_error(failure)}


def dead_letter_envelope(
    client: Any,
    settings: Settings,
    *,
    queue: str,
    envelope: Envelope,
    failure: Failure,
    consumer: str,
) -> str:
    """Write a dead-letter entry for a task whose stream entry is gone (acknowledged early).

    The ``raw.*`` fields are those of a stream entry holding ``envelope``, so the
    entry can be replayed like any other. Returns the dead-letter entry id.
    """
    fields = envelope_dead_fields(settings, envelope, failure, queue=queue, consumer=consumer)
    # Without a once-marker the entry is always written: its id is a string.
    return cast(str, write_dead_letter(client, settings, queue, fields,
                                       dead_record(settings, queue, envelope.task_id, failure)))


def dead_record(settings: Settings, queue: str, task_id: str, failure: Failure) -> RecordWrite:
    """The task record of a dead letter of ``task_id`` written outside ``dead_letter.lua``."""
    return record_write(settings, queue, task_id, TaskState.DEAD, _dead_record_fields(failure))


def envelope_dead_fields(settings: Settings, envelope: Envelope, failure: Failure, *,
                         queue: str, consumer: str) -> dict[str, Any]:
    """The fields of a dead-letter entry for ``envelope``: the failure's, then the raw
    fields of a stream entry holding it."""
    fields: dict[str, Any] = dict(failure_fields(failure, queue=queue, consumer=consumer))
    for name, value in encode_entry(envelope, settings.gzip_min_bytes,
                                    limits=settings.limits).items():
        fields["raw." + name] = value
    return fields


def write_dead_letter(client: Any, settings: Settings, queue: str, fields: dict[str, Any],
                      record: RecordWrite, *, once: str | None = None) -> str | None:
    """Add ``fields`` to ``queue``'s dead-letter stream, then ``record`` with its
    ``dead_id``; return the entry id.

    ``once`` (a token, e.g. an outbox row's) writes a marker in the same ``MULTI`` as the
    entry, and a call that finds the marker writes nothing and returns None: that dead
    letter exists already. Only one writer may hold a token at a time (an outbox row is
    locked by the relay that dead-letters it).
    """
    client.sadd(settings.keys.dead_queues, queue)  # first, on its own (section 2)
    keys = settings.keys.queue(queue)
    marker = None if once is None else keys.dead_once(once)
    if marker is not None and client.exists(marker):
        return None
    if not settings.wait_replicas and record.key is None and marker is None:
        return as_text(client.xadd(keys.dead, fields))
    # The entry id the record names is the XADD's reply: written right after it, in
    # the same round trip (a MULTI cannot use one command's reply in the next).
    pipe = write_pipeline(client, settings, transaction=marker is not None, key=keys.dead)
    pipe.xadd(keys.dead, fields)
    if marker is not None:
        pipe.set(marker, "1", px=settings.publish_dedupe_ms)
    dead_id = as_text(execute(pipe, settings, "dead letter")[0])
    if record.key is not None:
        pipe = client.pipeline(transaction=True)
        replace(record, fields={**record.fields, "dead_id": dead_id}).add_to(pipe)
        pipe.execute()
    return dead_id



@dataclass(frozen=True)
class DeadLetter:
    """One dead-letter entry: its failure fields, the raw original fields, its Envelope."""

    queue: str
    entry_id: str
    fields: dict[str, str]
    raw: dict[str, bytes]
    envelope: Envelope | None
    decode_error: str | None

    @property
    def failure_class(self) -> str:
        """Why it failed (a :class:`FailureClass` value)."""
        return self.fields.get("failure_class", "")

    @property
    def task_type(self) -> str | None:
        """The task type, from the Envelope or the failure fields."""
        return self.envelope.task_type if self.envelope else self.fields.get("task_type")

    @property
    def task_id(self) -> str | None:
        """The task id, from the Envelope or the failure fields."""
        return self.envelope.task_id if self.envelope else self.fields.get("task_id")

    @property
    def dead_at(self) -> datetime:
        """When it was dead-lettered (from the stream entry id)."""
        millis = int(self.entry_id.split("-", 1)[0])
        return datetime.fromtimestamp(millis / 1000, tz=timezone.utc)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view (raw bytes as text when they are UTF-8, else base64)."""
        raw = {}
        for name, value in self.raw.items():
            try:
                raw[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                raw[name] = "base64:" + base64.b64encode(value).decode("ascii")
        return {
            "queue": self.queue,
            "id": self.entry_id,
            **self.fields,
            "raw": raw,
            "envelope": json.loads(self.envelope.to_json()) if self.envelope else None,
            "decode_error": self.decode_error,
        }


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which entries to select; every given criterion must match."""

    task_type: str | None = None
    failure_class: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def id_range(self) -> tuple[str, str]:
        """XRANGE bounds from the time range (stream ids start with milliseconds)."""
        low = "-" if self.since is None else str(int(self.since.timestamp() * 1000))
        high = "+" if self.until is None else str(int(self.until.timestamp() * 1000))
        return low, high

    def matches(self, entry: DeadLetter) -> bool:
        """True when ``entry`` passes the filter."""
        return (self.task_type in (None, entry.task_type)
                and self.failure_class in (None, entry.failure_class))


def json_merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 JSON merge patch to ``target`` and return the result."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


@dataclass(frozen=True)
class ReplayEdit:
    """How to change a dead-lettered Envelope before publishing it again.

    ``payload`` replaces the payload; ``merge_patch`` is applied to it (RFC 7386);
    ``payload_version`` sets the version (``bump_version`` adds one instead);
    ``retry_count`` and ``max_retries`` override those fields (by default the
    retry count starts again at 0).
    """

    payload: dict[str, Any] | None = None
    merge_patch: dict[str, Any] | None = None
    payload_version: int | None = None
    bump_version: bool = False
    retry_count: int = 0
    max_retries: int | None = None

    def apply(self, envelope: Envelope, limits: Limits) -> Envelope:
        """The edited Envelope, validated; raises InvalidEnvelope."""
        data = json.loads(envelope.to_json())
        if self.payload is not None:
            data["payload"] = self.payload
        if self.merge_patch is not None:
            data["payload"] = json_merge_patch(data.get("payload", {}), self.merge_patch)
        if self.payload_version is not None:
            data["payload_version"] = self.payload_version
        elif self.bump_version:
            data["payload_version"] = envelope.payload_version + 1
        if self.max_retries is not None:
            data["max_retries"] = self.max_retries
        data["retry_count"] = self.retry_count
        data.pop("schedule_time", None)  # a replay runs now
        edited = Envelope.parse(data, limits)
        check_publishable(edited, limits)
        return edited


class DeadLetters:
    """List, show, count, purge and replay dead-letter entries."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.schemas = PayloadSchemas(client, self.settings)

    def queues(self) -> list[str]:
        """Queues that have had dead-letter entries."""
        return sorted(as_text(q) for q in self.client.smembers(self.settings.keys.dead_queues))

    def iter(self, queue: str, where: DeadLetterFilter | None = None,
             batch: int = 200) -> Iterator[DeadLetter]:
        """Entries of ``queue`` matching ``where``, oldest first."""
        where = where or DeadLetterFilter()
        low, high = where.id_range()
        stream = self.settings.keys.queue(queue).dead
        while True:
            entries = self.client.xrange(stream, low, high, count=batch)
            for entry_id, fields in entries:
                entry = self._entry(queue, as_text(entry_id), fields)
                if where.matches(entry):
                    yield entry
            if len(entries) < batch:
                return
            low = "(" + as_text(entries[-1][0])

    def list(self, queues: Iterable[str] | None = None, where: DeadLetterFilter | None = None,
             limit: int = 100) -> list[DeadLetter]:
        """Up to ``limit`` matching entries of ``queues`` (default: every queue)."""
        found: list[DeadLetter] = []
        for queue in queues or self.queues():
            for entry in self.iter(queue, where):
                if len(found) >= limit:
                    return found
                found.append(entry)
        return found

    def get(self, queue: str, entry_id: str) -> DeadLetter | None:
        """One entry by id, or None."""
        entries = self.client.xrange(self.settings.keys.queue(queue).dead, entry_id, entry_id)
        return self._entry(queue, entry_id, entries[0][1]) if entries else None

    def stats(self, queues: Iterable[str] | None = None,
              where: DeadLetterFilter | None = None) -> Counter[tuple[str, str, str]]:
        """Counts per (queue, task_type, failure_class)."""
        counts: Counter[tuple[str, str, str]] = Counter()
        for queue in queues or self.queues():
            for entry in self.iter(queue, where):
                counts[(queue, entry.task_type or "?", entry.failure_class)] += 1
        return counts

    def purge(self, queue: str, where: DeadLetterFilter | None = None) -> int:
        """Delete matching entries of ``queue``; return how many."""
        stream = self.settings.keys.queue(queue).dead
        ids = [entry.entry_id for entry in self.iter(queue, where)]
        for start in range(0, len(ids), 500):
            self.client.xdel(stream, *ids[start:start + 500])
        return len(ids)

    def edited(self, queue: str, entry_id: str,
               edit: ReplayEdit | None = None) -> Envelope | None:
        """The Envelope a replay would publish (a dry run), or None when the entry is gone.

        Raises InvalidEnvelope when the edited Envelope is invalid or its payload
        breaks its schema, and
        MalformedEntry when the entry holds no decodable Envelope.
        """
        entry = self.get(queue, entry_id)
        if entry is None:
            return None
        if entry.envelope is None:
            raise MalformedEntry(f"dead-letter entry {entry_id} holds no valid Envelope: "
                                 f"{entry.decode_error}")
        envelope = (edit or ReplayEdit()).apply(entry.envelope, self.settings.limits)
        self.schemas.check(envelope)
        return envelope

    def replay(self, queue: str, entry_id: str, edit: ReplayEdit | None = None,
               operator: str | None = None) -> str | None:
        """Publish a dead-lettered task again (edited first); return the new entry id, or
        ``"waiting"`` for a keyed task whose turn has not come (docs/protocol.md, section 20).

        Returns None when the entry is gone (someone replayed or purged it first);
        raises as :meth:`edited` does.
        """
        envelope = self.edited(queue, entry_id, edit)
        if envelope is None:
            return None
        enc, body = encode_body(envelope, self.settings.gzip_min_bytes,
                                limits=self.settings.limits)
        keys = self.settings.keys.queue(queue)
        record = ["replayed_at", format_rfc3339(utcnow()),
                  "operator", operator or f"{getpass.getuser()}@{socket.gethostname()}"]
        task_record = record_write(self.settings, queue, envelope.task_id, TaskState.QUEUED,
                                   envelope_fields(envelope, queue))
        if envelope.ordering_key is not None:  # promoters release its key's next tasks
            self.client.sadd(self.settings.keys.queues, queue)  # first, on its own (section 2)
        reply = script(self.client, "replay")(
            keys=[keys.dead, keys.stream(bucket_for(envelope.priority)), keys.replayed,
                  *task_record.keys],
            args=[entry_id, enc, body, *task_record.args, *record],
        )
        return as_text(reply) if reply else None

    def _entry(self, queue: str, entry_id: str, fields: dict[Any, Any]) -> DeadLetter:
        failure: dict[str, str] = {}
        raw: dict[str, bytes] = {}
        for name, value in fields.items():
            key = as_text(name)
            if key.startswith("raw."):
                raw[key[4:]] = value if isinstance(value, bytes) else str(value).encode()
            else:
                failure[key] = as_text(value)
        try:
            envelope, error = decode_entry(raw, self.settings.limits), None
        except MalformedEntry as exc:
            envelope, error = None, exc.reason
        return DeadLetter(queue, entry_id, failure, raw, envelope, error)
