"""Consumer liveness and the takeover of entries held by dead consumers.

Every consumer keeps a liveness key ``<prefix>:consumer:<name>`` that expires
after ``lease_ms``. A thread renews it every ``lease_ms / 3``, independently of
the event loop and of the tasks running, so a task that runs longer than the
lease on a live worker is never handed to anybody else. Only when the key has
expired (the process was killed, lost its host or its network) do other
consumers put the entries it held back into their streams.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from redis.exceptions import RedisError

from kombu_envelope.envelope import format_rfc3339, utcnow
from kombu_envelope.scripts import script
from kombu_envelope.settings import Settings

logger = logging.getLogger(__name__)

#: How many pending entries one takeover step examines per stream.
RECLAIM_BATCH = 100


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def renew(client: Any, settings: Settings, consumers: Iterable[str]) -> None:
    """Mark ``consumers`` alive for another ``lease_ms``."""
    value = f"{socket.gethostname()} {os.getpid()} python"
    pipe = client.pipeline(transaction=False)
    for consumer in consumers:
        pipe.set(settings.keys.consumer(consumer), value, px=settings.lease_ms)
    pipe.execute()


def reclaim_dead_consumers(client: Any, settings: Settings, queue: str) -> int:
    """Put the entries of ``queue`` held by dead consumers back into their streams.

    A consumer is dead when its liveness key is gone; an entry is taken back
    only once it has been idle for ``lease_ms``. Returns how many entries
    were requeued (or dead-lettered after ``max_redeliveries``).
    """
    keys = settings.keys.queue(queue)
    group = settings.consumer_group
    requeue = script(client, "requeue")
    moved = 0
    for stream in keys.all_streams:
        try:
            summary = client.xpending(stream, group)
        except RedisError:  # no stream or no group yet: nothing is pending
            continue
        owners = [_text(c["name"]) for c in summary.get("consumers") or []]
        if not owners:
            continue
        alive = client.exists(*[settings.keys.consumer(o) for o in owners]) if owners else 0
        if alive == len(owners):
            continue
        pipe = client.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(settings.keys.consumer(owner))
        for owner, is_alive in zip(owners, pipe.execute()):
            if is_alive:
                continue
            moved += _requeue_owned_by(client, settings, requeue, stream, owner, keys.dead)
    return moved


def _requeue_owned_by(client: Any, settings: Settings, requeue: Callable[..., Any],
                      stream: str, owner: str, dead: str) -> int:
    group = settings.consumer_group
    pending = client.xpending_range(
        stream, group, min="-", max="+", count=RECLAIM_BATCH, consumername=owner,
        idle=settings.lease_ms,
    )
    moved = 0
    now = format_rfc3339(utcnow())
    for item in pending:
        reply = requeue(
            keys=[stream, stream, dead],
            args=[group, _text(item["message_id"]), owner, settings.lease_ms, 1,
                  settings.max_redeliveries, now],
        )
        if reply:
            moved += 1
    if moved:
        logger.warning("took over %d entries of dead consumer %s on %s", moved, owner, stream)
    if len(pending) < RECLAIM_BATCH:
        remaining = client.xpending_range(stream, group, min="-", max="+", count=1,
                                          consumername=owner)
        if not remaining:
            client.xgroup_delconsumer(stream, group, owner)
    return moved


class LeaseKeeper:
    """Background thread that renews this process's consumers and reclaims dead ones'."""

    def __init__(self, client_factory: Callable[[], Any], settings: Settings) -> None:
        self._client_factory = client_factory
        self.settings = settings
        self._consumers: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The keeper's own Redis client (never shared with the event loop)."""
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    def register(self, consumer: str, queues: Iterable[str]) -> None:
        """Keep ``consumer`` alive (renewing now, synchronously) and watch ``queues``."""
        with self._lock:
            self._consumers[consumer] = frozenset(queues)
        renew(self.client, self.settings, [consumer])
        self._ensure_started()

    def unregister(self, consumer: str) -> None:
        """Stop renewing ``consumer`` and delete its liveness key."""
        with self._lock:
            known = self._consumers.pop(consumer, None)
        if known is not None:
            try:
                self.client.delete(self.settings.keys.consumer(consumer))
            except RedisError:
                logger.debug("could not delete liveness key of %s", consumer, exc_info=True)

    def stop(self) -> None:
        """Stop the thread (liveness keys then expire on their own)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _ensure_started(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="kombu-envelope-lease", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        interval_s = self.settings.lease_ms / 3000
        while not self._stop.wait(interval_s):
            with self._lock:
                consumers = dict(self._consumers)
            if not consumers:
                continue
            try:
                renew(self.client, self.settings, consumers)
                for queue in set().union(*consumers.values()):
                    reclaim_dead_consumers(self.client, self.settings, queue)
            except RedisError:
                logger.warning("lease renewal failed; retrying in %.1f s", interval_s,
                               exc_info=True)
