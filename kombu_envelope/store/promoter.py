"""The shared delayed-task scheduler: promotes due tasks from delayed sets to streams.

Publishers store a task whose ``schedule_time`` is ahead in its queue's
delayed set (``schedule.lua``). A :class:`Promoter` moves due tasks to their
priority stream with ``promote.lua``, atomically and in batches, so any
number of promoters may run at once: each task is delivered once, and a
promoter killed mid-batch loses nothing.

A promoter sleeps until the next due time, or until a publisher announces an
earlier one on the wake-up channel; it re-reads the queue registry at least
every ``max_idle_s`` seconds to notice new queues and missed wake-ups.

Run one standalone (for deployments without Python workers) with
``python -m kombu_envelope.scheduler`` (:mod:`kombu_envelope.scheduler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kombu_envelope.errors import InvalidQueueName
from kombu_envelope.settings import Settings
from kombu_envelope.store.cluster import forget_slot_owner
from kombu_envelope.store.scripts import script

logger = logging.getLogger(__name__)

#: Tasks moved by one promote.lua call.
DEFAULT_BATCH = 1000
#: Longest sleep without looking at the queue registry (seconds).
DEFAULT_MAX_IDLE_S = 15.0


def redis_now_ms(client: Any) -> int:
    """Redis server time in milliseconds: every promoter shares one clock."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


class Promoter:
    """Moves due delayed tasks of every registered queue into their streams."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        settings: Settings | None = None,
        batch: int = DEFAULT_BATCH,
        max_idle_s: float = DEFAULT_MAX_IDLE_S,
        jobs: Sequence[Callable[[int], int | None]] = (),
    ) -> None:
        self._client_factory = client_factory
        #: Extra work run on every pass with the Redis time in ms (periodic
        #: tasks, for example); each returns when it next needs to run, or None.
        self.jobs = list(jobs)
        self.settings = settings or Settings()
        self.batch = batch
        self.max_idle_s = max_idle_s
        self.client = client_factory()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def promote_queue(self, queue: str, now_ms: int) -> tuple[int, int | None]:
        """Move every task of ``queue`` due at ``now_ms``; return (moved, next due ms)."""
        keys = self.settings.keys.queue(queue)
        promote = script(self.client, "promote")
        moved_total = 0
        while True:
            moved, next_due = promote(
                keys=[keys.delayed, keys.delayed_data, *keys.task_streams],
                args=[now_ms, self.batch],
            )
            moved_total += moved
            if moved < self.batch:
                return moved_total, (None if next_due < 0 else int(next_due))

    def run_once(self, now_ms: int | None = None) -> tuple[int, int | None]:
        """One pass over every queue; return (tasks moved, earliest next due time in ms)."""
        now_ms = redis_now_ms(self.client) if now_ms is None else now_ms
        moved_total = 0
        earliest: int | None = None
        for raw in self.client.smembers(self.settings.keys.queues):
            queue = raw.decode() if isinstance(raw, bytes) else raw
            try:
                moved, next_due = self.promote_queue(queue, now_ms)
            except InvalidQueueName:  # written by some other client; never fatal
                logger.warning("skipping invalid queue name %r in %s", queue,
                               self.settings.keys.queues)
                continue
            moved_total += moved
            if next_due is not None and (earliest is None or next_due < earliest):
                earliest = next_due
        return moved_total, earliest

    def run(self) -> None:
        """Promote until :meth:`stop` is called; survives Redis restarts."""
        while not self._stop.is_set():
            try:
                self._run_subscribed()
            except (RedisConnectionError, RedisTimeoutError):
                logger.warning("promoter lost Redis; retrying in 1 s", exc_info=True)
                # On a Cluster the wake-up subscription follows the slot map, which only
                # a failed command refreshes: the node it lost may have failed over.
                forget_slot_owner(self.client)
                self._stop.wait(1.0)
            except Exception:  # a thread that dies would silently stop promotion
                logger.exception("promoter failed; retrying in 1 s")
                self._stop.wait(1.0)

    def _run_subscribed(self) -> None:
        pubsub = self._client_factory().pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.settings.keys.wakeup_channel)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                now_ms = redis_now_ms(self.client)
                moved, next_due = self.run_once(now_ms)
                if moved:
                    logger.debug("promoted %d due tasks", moved)
                for job in self.jobs:
                    job_next = job(now_ms)
                    if job_next is not None and (next_due is None or job_next < next_due):
                        next_due = job_next
                sleep_s = self.max_idle_s
                if next_due is not None:
                    # The pass itself took time: count from its start, not its end.
                    elapsed_s = time.monotonic() - started
                    sleep_s = min(sleep_s, max(next_due - now_ms, 0) / 1000 - elapsed_s)
                if sleep_s > 0:
                    self._wait_for_wakeup(pubsub, sleep_s)
        finally:
            pubsub.close()

    def _wait_for_wakeup(self, pubsub: Any, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, returning early on a wake-up or a stop."""
        step = min(timeout_s, 0.5)  # stay responsive to stop()
        remaining = timeout_s
        while remaining > 0 and not self._stop.is_set():
            if pubsub.get_message(timeout=min(step, remaining)) is not None:
                return
            remaining -= step

    def start(self) -> None:
        """Run in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="kombu-envelope-promoter",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread started by :meth:`start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
