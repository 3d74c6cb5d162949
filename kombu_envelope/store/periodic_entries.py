"""Periodic entries as stored by the shared scheduler: each entry's next occurrence.

Per queue, ``<prefix>:{<queue>}:periodic`` maps each entry name to its next occurrence
(ms since the Unix epoch) and ``fingerprint:<name>`` to the digest of its definition;
``<prefix>:periodic-queues`` lists the queues (docs/protocol.md, section 2). The
scheduler that writes them is :mod:`celery_ext.periodic`; this module only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kombu_envelope.errors import InvalidQueueName
from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

#: Start of the hash field holding an entry's fingerprint; entry names may not start with it.
FINGERPRINT_FIELD_PREFIX = "fingerprint:"


@dataclass(frozen=True)
class StoredPeriodicEntry:
    """One periodic entry: its queue, name, next occurrence and definition digest."""

    queue: str
    name: str
    next_run: datetime | None
    fingerprint: str | None


def _next_run(value: Any) -> datetime | None:
    try:
        return datetime.fromtimestamp(int(as_text(value)) / 1000, tz=timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


class PeriodicEntries:
    """Read-only view of the periodic entries of every queue."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()

    def queues(self) -> list[str]:
        """Queues that have periodic entries."""
        return sorted(as_text(q) for q in self.client.smembers(self.settings.keys.periodic_queues))

    def list(self, queue: str | None = None) -> list[StoredPeriodicEntry]:
        """Entries of ``queue`` (default: every queue), by queue then name."""
        found = []
        for name in [queue] if queue else self.queues():
            try:
                key = self.settings.keys.queue(name).periodic
            except InvalidQueueName:  # listed by some other client
                continue
            stored = {as_text(k): v for k, v in self.client.hgetall(key).items()}
            for entry, value in sorted(stored.items()):
                if entry.startswith(FINGERPRINT_FIELD_PREFIX):
                    continue
                fingerprint = stored.get(FINGERPRINT_FIELD_PREFIX + entry)
                found.append(StoredPeriodicEntry(
                    name, entry, _next_run(value),
                    None if fingerprint is None else as_text(fingerprint)))
        return found

    def get(self, queue: str, name: str) -> StoredPeriodicEntry | None:
        """One entry, or None."""
        if name.startswith(FINGERPRINT_FIELD_PREFIX):
            return None
        key = self.settings.keys.queue(queue).periodic
        value, fingerprint = self.client.hmget(key, [name, FINGERPRINT_FIELD_PREFIX + name])
        if value is None:
            return None
        return StoredPeriodicEntry(queue, name, _next_run(value),
                                   None if fingerprint is None else as_text(fingerprint))
