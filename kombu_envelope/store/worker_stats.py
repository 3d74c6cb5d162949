"""Worker statistics: the counts of runs, outcomes and waits (docs/protocol.md, section 17).

A worker sums its increments per queue and field in a :class:`StatsBuffer` and writes
them either in a ``MULTI`` it sends anyway for the attempt (:meth:`StatsBuffer.ride`,
with the task record or the acknowledgement, at most once every :data:`RIDE_EVERY_S` per
queue) or on their own (:meth:`StatsBuffer.flush`: one ``MULTI`` of ``HINCRBY`` and
``PEXPIRE`` per queue, in the queue's slot, so it runs on a Cluster too). Riding on every
attempt's ``MULTI`` would add about five commands to each; once a second keeps the hash
as fresh as a scrape needs at any traffic. Increments whose write failed are kept for
the next one. :func:`process_buffer` is the buffer of this process (a forked child gets
its own); :class:`Flusher` writes it on a timer.

:func:`read_stats` turns a queue's hash into counters and cumulative histograms for
each task type and language.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

__all__ = ["BOUNDS", "COUNTERS", "RIDE_EVERY_S", "STATS_TTL_MS", "UNDECODED", "Flusher",
           "Histogram", "StatsBuffer", "TaskStats", "field_name", "observation", "parse_stats",
           "process_buffer", "read_stats", "wait_seconds"]

logger = logging.getLogger(__name__)

#: Upper bounds of the histogram buckets, in seconds, as written in the field names.
BOUNDS: tuple[str, ...] = ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1",
                           "2.5", "5", "10", "30", "60", "300", "900", "3600", "inf")
#: The counter names of the hash, in the order readers list them.
COUNTERS: tuple[str, ...] = ("succeeded", "failed", "retried", "dead", "duplicate")
#: The histograms of the hash: ``run`` (how long a handler ran), ``wait`` (to start).
HISTOGRAMS: tuple[str, ...] = ("run", "wait")
#: The expiry every write of a stats hash refreshes (ms): 30 days.
STATS_TTL_MS = 2_592_000_000
#: Seconds between two writes of a queue's counts riding on an attempt's ``MULTI``.
RIDE_EVERY_S = 1.0
#: The task type counted for an entry whose Envelope could not be decoded.
UNDECODED = "-"
#: The language this SDK writes.
LANGUAGE = "python"

_LIMITS = tuple(float(bound) for bound in BOUNDS)


def field_name(task_type: str, name: str, language: str = LANGUAGE) -> str:
    """The hash field ``<task_type> <language> <name>``."""
    return f"{task_type} {language} {name}"


def observation(histogram: str, seconds: float) -> dict[str, int]:
    """The increments of one observation of ``seconds`` in ``histogram`` (``run`` or
    ``wait``): 1 in the first bucket whose bound is at least ``seconds`` and the
    microseconds in ``<histogram>_sum_us``; a negative duration counts as 0."""
    seconds = max(0.0, seconds)
    bound = next(text for text, limit in zip(BOUNDS, _LIMITS) if seconds <= limit)
    return {f"{histogram}_le_{bound}": 1, f"{histogram}_sum_us": round(seconds * 1_000_000)}


def wait_seconds(started_ms: int, due_ms: int) -> float:
    """How long an attempt waited to start: its start minus when it was due (both ms
    since the Unix epoch), 0 when it started early."""
    return max(0, started_ms - due_ms) / 1000


class StatsBuffer:
    """Increments per queue and field, summed in memory until they are written.

    Thread-safe. It holds at most one value per field the hash would hold (41 per
    task type and language), whatever the traffic.
    """

    def __init__(self, settings: Settings, language: str = LANGUAGE) -> None:
        self.settings = settings
        self.language = language
        self._counts: dict[str, dict[str, int]] = {}
        self._rode: dict[str, float] = {}  # queue -> monotonic time of its last ride
        self._lock = threading.Lock()
        self._failing = False

    def add(self, queue: str, task_type: str, increments: Mapping[str, int]) -> None:
        """Add ``increments`` (name → amount) of ``task_type`` on ``queue``."""
        fields = {field_name(task_type, name, self.language): amount
                  for name, amount in increments.items()}
        self._merge(queue, fields)

    def count(self, queue: str, task_type: str, name: str) -> None:
        """Add 1 to counter ``name`` (``succeeded``, ``dead``...) of ``task_type``."""
        self.add(queue, task_type, {name: 1})

    def queues(self) -> list[str]:
        """The queues with increments not written yet."""
        with self._lock:
            return list(self._counts)

    def take(self, queue: str) -> dict[str, int]:
        """Remove and return the fields of ``queue`` (give them back if the write fails)."""
        with self._lock:
            return self._counts.pop(queue, {})

    def give_back(self, queue: str, fields: Mapping[str, int]) -> None:
        """Keep ``fields`` of a failed write for the next one."""
        self._merge(queue, fields)

    def add_to(self, pipe: Any, queue: str) -> dict[str, int]:
        """Queue the ``HINCRBY``s and the ``PEXPIRE`` of ``queue`` on ``pipe`` (a ``MULTI``
        in the queue's slot); returns what was taken, to :meth:`give_back` on failure."""
        fields = self.take(queue)
        if fields:
            key = self.settings.keys.queue(queue).stats
            for name, amount in fields.items():
                pipe.hincrby(key, name, amount)
            pipe.pexpire(key, STATS_TTL_MS)
        return fields

    def ride(self, pipe: Any, queue: str) -> dict[str, int]:
        """:meth:`add_to` for a ``MULTI`` sent anyway for an attempt (its task record, its
        acknowledgement): only when the queue's counts last rode :data:`RIDE_EVERY_S` ago
        or more, else nothing is queued and they wait (for a later ride, or the timer)."""
        now = time.monotonic()
        with self._lock:
            if now - self._rode.get(queue, -math.inf) < RIDE_EVERY_S:
                return {}
            self._rode[queue] = now
        return self.add_to(pipe, queue)

    def flush(self, client: Any) -> bool:
        """Write every queue's increments, one ``MULTI`` per queue; False when a write
        failed (its increments are kept). Never raises for a Redis error."""
        written = True
        for queue in self.queues():
            pipe = client.pipeline(transaction=True)
            fields = self.add_to(pipe, queue)
            if not fields:
                continue
            try:
                pipe.execute()
            except Exception as exc:  # statistics never fail anything
                self.give_back(queue, fields)
                self.failed(exc)
                written = False
        if written:
            self._failing = False
        return written

    def failed(self, exc: BaseException) -> None:
        """Log a failed write: a warning for the first of a series, then at debug."""
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        logger.log(level, "writing worker statistics failed (%r); kept for the next write",
                   exc)

    def _merge(self, queue: str, fields: Mapping[str, int]) -> None:
        with self._lock:
            counts = self._counts.setdefault(queue, {})
            for name, amount in fields.items():
                counts[name] = counts.get(name, 0) + amount


_buffers: dict[tuple[int, str], StatsBuffer] = {}
_buffers_lock = threading.Lock()


def _new_lock_in_child() -> None:
    """A fork may copy the lock held by another thread: the child starts with a free one."""
    global _buffers_lock
    _buffers_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def process_buffer(settings: Settings) -> StatsBuffer:
    """The buffer of this process for ``settings``' key prefix (a new one after a fork:
    counts a child makes are written by that child)."""
    key = (os.getpid(), settings.key_prefix)
    with _buffers_lock:
        buffer = _buffers.get(key)
        if buffer is None:
            buffer = _buffers[key] = StatsBuffer(settings)
        return buffer


class Flusher:
    """A daemon thread that flushes a buffer every ``period_s`` with its own client."""

    def __init__(self, buffer: StatsBuffer, client: Callable[[], Any], period_s: float) -> None:
        self.buffer = buffer
        self._client = client
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kombu-envelope-stats",
                                        daemon=True)

    def start(self) -> Flusher:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and flush once more."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 1)
        self.buffer.flush(self._client())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.buffer.flush(self._client())


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram: ``buckets`` pairs each bound (``"inf"`` last) with the
    observations at most that long; ``sum_s`` in seconds; ``count`` of observations."""

    buckets: tuple[tuple[str, int], ...]
    sum_s: float
    count: int


@dataclass(frozen=True)
class TaskStats:
    """The counts of one task type and language on one queue."""

    task_type: str
    language: str
    counters: dict[str, int] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


def parse_stats(hash_fields: Mapping[Any, Any]) -> list[TaskStats]:
    """The counters (every name of :data:`COUNTERS`, 0 when absent) and cumulative
    histograms of a stats hash, by task type and language; fields that are not the
    section's (another name, a value that is not an integer) are left out."""
    raw: dict[tuple[str, str], dict[str, int]] = {}
    for name, value in hash_fields.items():
        parts = as_text(name).rsplit(" ", 2)
        try:
            amount = int(as_text(value))
        except ValueError:
            continue
        if len(parts) == 3 and parts[0]:
            raw.setdefault((parts[0], parts[1]), {})[parts[2]] = amount
    return [TaskStats(task_type, language,
                      {name: fields.get(name, 0) for name in COUNTERS},
                      {name: _histogram(fields, name) for name in HISTOGRAMS})
            for (task_type, language), fields in sorted(raw.items())]


def _histogram(fields: Mapping[str, int], name: str) -> Histogram:
    total = 0
    buckets = []
    for bound in BOUNDS:
        total += fields.get(f"{name}_le_{bound}", 0)
        buckets.append((bound, total))
    return Histogram(tuple(buckets), fields.get(f"{name}_sum_us", 0) / 1_000_000, total)


def read_stats(client: Any, settings: Settings, queue: str) -> list[TaskStats]:
    """The statistics of ``queue`` (one ``HGETALL``)."""
    return parse_stats(client.hgetall(settings.keys.queue(queue).stats))
