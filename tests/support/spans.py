"""The spans ``limits.task`` records in every language (``<prefix>:mx:spans``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

__all__ = ["Span", "max_overlap", "spans"]


@dataclass(frozen=True)
class Span:
    """One run of ``limits.task`` or ``limits.fast``: who ran it, from when to when (unix ms)."""

    language: str
    task_id: str
    start_ms: float
    end_ms: float


def spans(client: redis.Redis, prefix: str) -> list[Span]:
    """Every span recorded so far, in the order they ended."""
    return [Span(**json.loads(raw)) for raw in client.lrange(f"{prefix}:mx:spans", 0, -1)]


def max_overlap(runs: list[Span]) -> int:
    """The most runs that were running at one moment (a run ending as another starts does
    not overlap it)."""
    events = sorted([(s.start_ms, 1) for s in runs] + [(s.end_ms, -1) for s in runs],
                    key=lambda event: (event[0], event[1]))
    running = most = 0
    for _at, step in events:
        running += step
        most = max(most, running)
    return most
