"""Losing a publisher's connection in the middle of a batch, right after it wrote steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from kombu_envelope.store.batch import Batch

__all__ = ["connection_lost_after_flushes"]


@contextmanager
def connection_lost_after_flushes(monkeypatch: pytest.MonkeyPatch, redis_url: str,
                                  *flushes: int) -> Iterator[list[int]]:
    """While inside, the ``Batch.flush`` calls numbered ``flushes`` (1: the first) are
    followed by a ``CLIENT KILL`` of every other normal connection, the writer's with them;
    yields the count each kill reported."""
    killer, flush, done, killed = redis.Redis.from_url(redis_url), Batch.flush, [0], []

    def flush_then_lose_the_connection(batch: Batch) -> None:
        flush(batch)
        done[0] += 1
        if done[0] in flushes:
            killed.append(killer.client_kill_filter(_type="normal", skipme=True))

    monkeypatch.setattr(Batch, "flush", flush_then_lose_the_connection)
    try:
        yield killed
    finally:
        monkeypatch.setattr(Batch, "flush", flush)
        killer.close()
