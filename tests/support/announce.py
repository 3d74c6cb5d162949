"""Announce a worker (docs/protocol.md, section 15) so the dispatcher takes tasks for a queue."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import redis

from kombu_envelope import Settings
from kombu_envelope.store.announcements import Announcements, WorkerAnnouncement


def announce(redis_url: str, key_prefix: str, queue: str, serves: dict[str, list[int]]) -> None:
    """A worker on ``queue`` seen just now, serving ``serves`` (task type -> versions)."""
    client = redis.Redis.from_url(redis_url)
    now = datetime.now(timezone.utc)
    try:
        Announcements(client, Settings(key_prefix=key_prefix)).announce(WorkerAnnouncement(
            consumer=f"test-{uuid.uuid4().hex[:8]}", language="python", host="localhost",
            pid=1, queues=[queue], serves=serves, concurrency=1, started_at=now, seen_at=now,
            stopped_at=None, live=True))
    finally:
        client.close()
