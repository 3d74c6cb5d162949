"""Worker announcements: which task types and payload versions each worker serves
(docs/protocol.md, section 15).

A worker writes ``<prefix>:worker:<consumer>`` (JSON, ``SET ... PX announce_keep_s``)
before its first read and with every liveness renewal, after ``ZADD <prefix>:workers``
(sent first and awaited: section 2). A worker is live while its liveness key exists and
recently seen while its announcement does; a clean shutdown writes ``stopped_at`` and
keeps the announcement.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from kombu_envelope.envelope import format_rfc3339, parse_rfc3339, utcnow
from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

__all__ = ["Announcements", "WorkerAnnouncement"]

#: Members of ``<prefix>:workers`` older than this are dropped by readers (ms): a day.
FORGET_WORKERS_MS = 86_400_000


@dataclass(frozen=True)
class WorkerAnnouncement:
    """What one consumer serves. ``serves`` maps a task type to the payload versions it
    accepts (an empty list: every version); ``live`` is set by readers."""

    consumer: str
    language: str
    host: str
    pid: int
    queues: list[str]
    serves: dict[str, list[int]] = field(default_factory=dict)
    concurrency: int | None = None
    started_at: datetime | None = None
    seen_at: datetime | None = None
    stopped_at: datetime | None = None
    live: bool = False
    #: How often the announcement is written again (ms), the liveness renewal period.
    heartbeat_ms: int | None = None

    @classmethod
    def of_this_process(cls, consumer: str, queues: Iterable[str],
                        serves: Mapping[str, Iterable[int]] | None = None,
                        concurrency: int | None = None) -> WorkerAnnouncement:
        """The announcement of a Python consumer of this process, started now."""
        return cls(consumer, "python", socket.gethostname(), os.getpid(), sorted(queues),
                   {name: sorted(versions) for name, versions in (serves or {}).items()},
                   concurrency, started_at=utcnow())

    def serves_task(self, task_type: str, payload_version: int) -> bool:
        """True when this worker has a handler for the type that accepts the version."""
        versions = self.serves.get(task_type)
        return versions is not None and (not versions or payload_version in versions)

    def to_json(self) -> str:
        """The value stored under ``<prefix>:worker:<consumer>``."""
        value: dict[str, Any] = {
            "consumer": self.consumer, "language": self.language, "host": self.host,
            "pid": self.pid, "queues": self.queues, "serves": self.serves,
            "concurrency": self.concurrency}
        if self.heartbeat_ms is not None:
            value["heartbeat_ms"] = self.heartbeat_ms
        for name in ("started_at", "seen_at", "stopped_at"):
            moment = getattr(self, name)
            if moment is not None:
                value[name] = format_rfc3339(moment)
        return json.dumps(value, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, live: bool = False) -> WorkerAnnouncement:
        """Parse a stored announcement; raises ValueError when it is not one."""
        value = json.loads(text)
        if not isinstance(value, dict) or not isinstance(value.get("consumer"), str):
            raise ValueError("an announcement is a JSON object with a consumer")
        serves = value.get("serves") or {}
        return cls(
            consumer=value["consumer"], language=str(value.get("language", "")),
            host=str(value.get("host", "")), pid=int(value.get("pid") or 0),
            queues=[str(queue) for queue in value.get("queues") or []],
            serves={str(name): [int(v) for v in versions or []]
                    for name, versions in serves.items()},
            concurrency=value.get("concurrency"),
            started_at=_time(value.get("started_at")), seen_at=_time(value.get("seen_at")),
            stopped_at=_time(value.get("stopped_at")), live=live,
            heartbeat_ms=_int(value.get("heartbeat_ms")))


class Announcements:
    """Writes and reads worker announcements."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()

    def announce(self, *announcements: WorkerAnnouncement,
                 also: Callable[[Any], None] | None = None) -> None:
        """Write ``announcements``, seen now: the registry's ZADD first (awaited), then
        each SET PX. ``also`` (a callable given the pipeline) adds the caller's own
        commands, such as liveness renewals, to the round trip of the SETs."""
        keys = self.settings.keys
        now = utcnow()
        if announcements:
            now_ms = int(now.timestamp() * 1000)
            self.client.zadd(keys.workers, {a.consumer: now_ms for a in announcements})
        pipe = self.client.pipeline(transaction=False)
        if also is not None:
            also(pipe)
        keep_ms = self.settings.announce_keep_s * 1000
        for announcement in announcements:
            seen = replace(announcement, seen_at=now,
                           heartbeat_ms=self.settings.lease_ms // 3)
            pipe.set(keys.worker(announcement.consumer), seen.to_json(), px=keep_ms)
        pipe.execute()

    def workers(self, queue: str | None = None) -> list[WorkerAnnouncement]:
        """The live and recently seen workers (of ``queue``), by consumer name."""
        keys = self.settings.keys
        now_ms = int(utcnow().timestamp() * 1000)
        self.client.zremrangebyscore(keys.workers, "-inf", now_ms - FORGET_WORKERS_MS)
        consumers = [as_text(name) for name in self.client.zrange(keys.workers, 0, -1)]
        if not consumers:
            return []
        pipe = self.client.pipeline(transaction=False)
        for consumer in consumers:
            pipe.get(keys.worker(consumer))
            pipe.exists(keys.consumer(consumer))
        replies = pipe.execute()
        found = []
        for stored, live in zip(replies[::2], replies[1::2]):
            if stored is None:
                continue
            try:
                announcement = WorkerAnnouncement.from_json(stored, live=bool(live))
            except (ValueError, TypeError, AttributeError):
                continue  # written by something else: not an announcement
            if queue is None or queue in announcement.queues:
                found.append(announcement)
        return sorted(found, key=lambda a: a.consumer)

    def served(self, queue: str, task_type: str, payload_version: int) -> bool:
        """True when a live or recently seen worker of ``queue`` serves the type and version."""
        return any(worker.serves_task(task_type, payload_version)
                   for worker in self.workers(queue))

    def serving_queues(self, task_type: str, payload_version: int) -> list[str]:
        """The queues whose live or recently seen workers serve the type and version: those
        with a live one first, then by name (docs/protocol.md, section 15, routing)."""
        live: set[str] = set()
        seen: set[str] = set()
        for worker in self.workers():
            if worker.serves_task(task_type, payload_version):
                (live if worker.live else seen).update(worker.queues)
        return sorted(live) + sorted(seen - live)

    def serves_on(self, queue: str) -> dict[str, list[int]]:
        """What the workers of ``queue`` serve, merged (for error messages); a type some
        worker serves in every version maps to ``[]``."""
        merged: dict[str, set[int] | None] = {}
        for worker in self.workers(queue):
            for task_type, versions in worker.serves.items():
                known = merged.get(task_type, set())
                merged[task_type] = None if known is None or not versions else \
                    known | set(versions)
        return {task_type: sorted(versions or ()) for task_type, versions
                in sorted(merged.items())}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _time(value: Any) -> datetime | None:
    try:
        return parse_rfc3339(value) if value else None
    except ValueError:
        return None
