"""Liveness bookkeeping: forgetting dead consumers without losing what they hold."""

from __future__ import annotations

import time

import pytest
import redis

from kombu_envelope.settings import Settings
from kombu_envelope.store import lease
from kombu_envelope.store.lease import forget_dead_consumers, renew

QUEUE = "jobs"


def _take_one(client: redis.Redis, stream: str, group: str, consumer: str) -> bytes:
    """Join the group as ``consumer`` by reading one entry; return its id."""
    ((_, [(entry_id, _)]),) = client.xreadgroup(group, consumer, {stream: ">"}, count=1)
    return entry_id


def test_only_dead_consumers_holding_nothing_are_forgotten(
    redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given three consumers of one stream: a dead one holding nothing, a dead one
    # holding an entry, and a live one holding nothing
    monkeypatch.setattr(lease, "FORGET_AFTER_MS", 0)
    settings = Settings(key_prefix=key_prefix, lease_ms=1)
    stream = settings.keys.queue(QUEUE).task_streams[1]
    group = settings.consumer_group
    redis_client.xgroup_create(stream, group, id="0", mkstream=True)
    for consumer in ("dead-empty", "dead-holding", "alive-empty"):
        redis_client.xadd(stream, {"v": "1"})
        entry_id = _take_one(redis_client, stream, group, consumer)
        if consumer != "dead-holding":
            redis_client.xack(stream, group, entry_id)
    renew(redis_client, Settings(key_prefix=key_prefix, lease_ms=60_000), ["alive-empty"])
    time.sleep(0.01)  # the dead ones' lease (1 ms) has passed: idle counts whole milliseconds

    # When the dead consumers are looked for
    removed = forget_dead_consumers(redis_client, settings, QUEUE)

    # Then only the dead one holding nothing is gone; the entry is still pending
    names = {c["name"].decode() for c in redis_client.xinfo_consumers(stream, group)}
    assert removed == 1
    assert names == {"dead-holding", "alive-empty"}
    assert redis_client.xpending(stream, group)["pending"] == 1
