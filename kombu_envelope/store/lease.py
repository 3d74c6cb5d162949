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
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError

from kombu_envelope.codec import decode_entry
from kombu_envelope.dead_letter_entry import RAW_PREFIX
from kombu_envelope.envelope import utcnow
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.failures import Failure, FailureClass, failure_fields
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import Announcements, WorkerAnnouncement
from kombu_envelope.store.outages import AnsweredAtOnce, is_outage
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.scripts import script
from kombu_envelope.store.task_records import TaskState, entry_record
from kombu_envelope.store.worker_stats import UNDECODED, process_buffer

logger = logging.getLogger(__name__)

#: The reserved consumer holding parked entries (section 19): never taken over.
PARKED_CONSUMER = "parked"
#: How many pending entries one takeover step examines per stream.
RECLAIM_BATCH = 100
#: A dead consumer holding nothing is removed from its group once idle this long (ms).
FORGET_AFTER_MS = 3_600_000
#: How often a live consumer looks for such consumers (seconds).
FORGET_CHECK_S = 60.0


def renew(client: Any, settings: Settings, consumers: Iterable[str],
          announcements: Iterable[WorkerAnnouncement] = (),
          slots: Iterable[tuple[str, str]] = ()) -> None:
    """Mark ``consumers`` alive for another ``lease_ms``, and write ``announcements``
    (their registry first, docs/protocol.md section 15) in the same round trip, with
    the deadlines of the concurrency ``slots`` they hold, (running key, member)
    (section 19: ``ZADD XX``, so a slot freed meanwhile is not taken again)."""
    value = f"{socket.gethostname()} {os.getpid()} python"

    def liveness(pipe: Any) -> None:
        for consumer in consumers:
            pipe.set(settings.keys.consumer(consumer), value, px=settings.lease_ms)
        deadline = int(time.time() * 1000) + settings.lease_ms
        for key, member in slots:
            pipe.zadd(key, {member: deadline}, xx=True)

    Announcements(client, settings).announce(*announcements, also=liveness)


def reclaim_dead_consumers(client: Any, settings: Settings, queue: str) -> int:
    """Put the entries of ``queue`` held by dead consumers back into their streams.

    A consumer is dead when its liveness key is gone; an entry is taken back
    only once it has been idle for ``lease_ms``. Returns how many entries
    were requeued (or dead-lettered after ``max_redeliveries``). Raises
    :class:`~kombu_envelope.store.outages.WaitedForRedis` when the liveness
    checks of a stream waited for Redis (its keys may have expired meanwhile).
    """
    keys = settings.keys.queue(queue)
    moved = 0
    for stream in keys.all_streams:
        watch = AnsweredAtOnce(settings.lease_ms / 3000)
        try:
            summary = client.xpending(stream, settings.consumer_group)
        except RedisError as error:  # no stream or no group yet: nothing is pending
            if is_outage(error):
                raise
            continue
        owners = [name for c in summary.get("consumers") or []
                  if (name := as_text(c["name"])) != PARKED_CONSUMER]
        if not owners:
            continue
        pipe = client.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(settings.keys.consumer(owner))
        alive = pipe.execute()
        watch.check(f"the liveness checks of {stream}")
        for owner, is_alive in zip(owners, alive):
            if not is_alive:
                moved += _requeue_owned_by(client, settings, queue, stream, owner)
    return moved


def _requeue_owned_by(client: Any, settings: Settings, queue: str, stream: str,
                      owner: str) -> int:
    group = settings.consumer_group
    pending = client.xpending_range(
        stream, group, min="-", max="+", count=RECLAIM_BATCH, consumername=owner,
        idle=settings.lease_ms,
    )
    requeue = script(client, "requeue")
    dead_fields = failure_fields(
        Failure(FailureClass.REDELIVERY_LIMIT, "its consumer kept dying while holding it"),
        queue=queue, consumer=owner,
    )
    if pending:
        # Listed before the takeover, which may dead-letter (section 2, registries).
        client.sadd(settings.keys.dead_queues, queue)
    moved = 0
    for item in pending:
        entry_id = as_text(item["message_id"])
        record = entry_record(client, settings, queue, stream, entry_id, TaskState.QUEUED,
                              may_die=True)
        reply = requeue(
            keys=[stream, stream, settings.keys.queue(queue).dead, *record.keys],
            args=[group, entry_id, owner, settings.lease_ms, 1,
                  settings.max_redeliveries, dead_fields["dead_at"], *record.args,
                  *_pairs(dead_fields, _REQUEUE_DEAD_FIELDS)],
        )
        if reply:
            moved += 1
            if as_text(reply).startswith("dead:"):
                _count_dead(client, settings, queue, as_text(reply)[len("dead:"):])
    if moved:
        logger.warning("took over %d entries of dead consumer %s on %s", moved, owner, stream)
    return moved


def _count_dead(client: Any, settings: Settings, queue: str, dead_id: str) -> None:
    """Count a takeover's dead letter for this consumer (section 17), under the task type
    of the entry it moved (``-`` when that does not decode)."""
    task_type = UNDECODED
    try:
        found = client.xrange(settings.keys.queue(queue).dead, dead_id, dead_id)
    except RedisError as exc:  # counted as undecoded rather than not at all
        logger.debug("reading dead-letter entry %s failed: %r", dead_id, exc)
        found = []
    if found:
        raw = {as_text(name)[len(RAW_PREFIX):]: value for name, value in found[0][1].items()
               if as_text(name).startswith(RAW_PREFIX)}
        try:
            task_type = decode_entry(raw, settings.limits).task_type
        except MalformedEntry:
            pass
    process_buffer(settings).count(queue, task_type, "dead")


def forget_dead_consumers(client: Any, settings: Settings, queue: str) -> int:
    """Remove from ``queue``'s groups the dead consumers that hold nothing.

    Only consumers without a liveness key, idle for :data:`FORGET_AFTER_MS`,
    go, each with forget_consumer.lua, which re-checks in the same step that
    they hold nothing. Returns how many were removed.
    """
    forget = script(client, "forget_consumer")
    idle_ms = max(FORGET_AFTER_MS, settings.lease_ms)
    removed = 0
    for stream in settings.keys.queue(queue).all_streams:
        try:
            consumers = client.xinfo_consumers(stream, settings.consumer_group)
        except RedisError:  # no stream or no group yet
            continue
        idle = [as_text(c["name"]) for c in consumers
                if c["pending"] == 0 and c["idle"] >= idle_ms]
        if not idle:
            continue
        pipe = client.pipeline(transaction=False)
        for name in idle:
            pipe.exists(settings.keys.consumer(name))
        for name, is_alive in zip(idle, pipe.execute()):
            if not is_alive:
                removed += forget(keys=[stream], args=[settings.consumer_group, name, idle_ms])
    return removed


# Failure fields requeue.lua adds to a dead-letter entry (it writes the others itself).
_REQUEUE_DEAD_FIELDS = ("queue", "language", "host", "pid", "consumer", "first_failure_at",
                        "last_failure_at")


def _pairs(fields: dict[str, str], names: tuple[str, ...]) -> list[str]:
    return [item for name in names for item in (name, fields[name])]


class LeaseKeeper:
    """Background thread that renews this process's consumers and reclaims dead ones'.

    One keeper serves every connection of a process to the same Redis and key prefix
    (:func:`process_keeper`), so a consumer stays alive across reconnections for as
    long as it is registered: a channel that closed while tasks it delivered still
    run stays registered until they are settled. The thread ends when nothing is
    registered and starts again with the next registration.

    After Redis was unreachable, live consumers have not renewed yet and look dead
    for a moment; so the keeper takes over entries only once it has renewed
    successfully for two intervals in a row, each renewal answered at once (one
    that waited through an outage starts the count again).
    """

    def __init__(self, client_factory: Callable[[], Any], settings: Settings) -> None:
        self._client_factory = client_factory
        self.settings = settings
        self._consumers: dict[str, frozenset[str]] = {}
        self._announcements: dict[str, WorkerAnnouncement] = {}
        self._slots: dict[str, Callable[[], list[tuple[str, str]]]] = {}
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

    def register(self, consumer: str, queues: Iterable[str],
                 announcement: WorkerAnnouncement | None = None,
                 slots: Callable[[], list[tuple[str, str]]] | None = None) -> None:
        """Keep ``consumer`` alive (renewing now, synchronously) and watch ``queues``;
        ``announcement`` is written with every renewal (docs/protocol.md, section 15),
        and so are the deadlines of the concurrency slots ``slots()`` names (section 19)."""
        with self._lock:
            self._consumers[consumer] = frozenset(queues)
            if announcement is not None:
                self._announcements[consumer] = announcement
            if slots is not None:
                self._slots[consumer] = slots
            announced = [a for a in [self._announcements.get(consumer)] if a is not None]
        renew(self.client, self.settings, [consumer], announced, self._held_slots([consumer]))
        self._ensure_started()

    def unregister(self, consumer: str) -> None:
        """Stop renewing ``consumer``, delete its liveness key, announce it stopped and
        write this process's statistics."""
        with self._lock:
            known = self._consumers.pop(consumer, None)
            announcement = self._announcements.pop(consumer, None)
            self._slots.pop(consumer, None)
        if known is None:
            return
        try:
            if announcement is not None:
                Announcements(self.client, self.settings).announce(
                    replace(announcement, stopped_at=utcnow()))
            self.client.delete(self.settings.keys.consumer(consumer))
        except RedisError:
            logger.debug("could not delete liveness key of %s", consumer, exc_info=True)
        process_buffer(self.settings).flush(self.client)

    def stop(self) -> None:
        """Stop the thread (liveness keys then expire on their own) and close its client."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if self._client is not None:
            self._client.close()
            self._client = None

    def _ensure_started(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="kombu-envelope-lease", daemon=True
                )
                self._thread.start()

    def _watched(self) -> dict[str, frozenset[str]] | None:
        """The consumers to renew, or None (the thread is done, its client closed) when
        there are none."""
        with self._lock:
            if not self._consumers:
                self._thread = None
                client, self._client = self._client, None
                if client is not None:
                    client.close()
                return None
            return dict(self._consumers)

    def _announced(self, consumers: Iterable[str]) -> list[WorkerAnnouncement]:
        with self._lock:
            return [self._announcements[c] for c in consumers if c in self._announcements]

    def _held_slots(self, consumers: Iterable[str]) -> list[tuple[str, str]]:
        with self._lock:
            sources = [self._slots[c] for c in consumers if c in self._slots]
        return [slot for source in sources for slot in source()]

    def _run(self) -> None:
        interval_s = self.settings.lease_ms / 3000
        forget_every = max(1, int(FORGET_CHECK_S / interval_s))
        rounds = 0
        renewed_in_a_row = 0
        wait_s = interval_s
        while not self._stop.wait(wait_s):
            wait_s = interval_s
            consumers = self._watched()
            if consumers is None:
                return
            rounds += 1
            watch = AnsweredAtOnce(interval_s)
            try:
                renew(self.client, self.settings, consumers, self._announced(consumers),
                      self._held_slots(consumers))
            except RedisError:
                renewed_in_a_row = 0
                wait_s = interval_s / 10  # promptly: the key must be back soon after Redis
                logger.warning("lease renewal failed; retrying in %.1f s", wait_s,
                               exc_info=True)
                continue
            process_buffer(self.settings).flush(self.client)
            if watch.waited():  # Redis was away: others may not have renewed yet
                renewed_in_a_row = 0
                continue
            renewed_in_a_row += 1
            if renewed_in_a_row < 2:
                continue
            try:
                for queue in set().union(*consumers.values()):
                    reclaim_dead_consumers(self.client, self.settings, queue)
                    if rounds % forget_every == 0:
                        forget_dead_consumers(self.client, self.settings, queue)
            except RedisError:
                renewed_in_a_row = 0
                logger.warning("taking over dead consumers' entries failed; retrying later",
                               exc_info=True)


_process_keepers: dict[tuple[Any, ...], LeaseKeeper] = {}
_process_keepers_lock = threading.Lock()


def process_keeper(identity: tuple[Any, ...], client_factory: Callable[[], Any],
                   settings: Settings) -> LeaseKeeper:
    """The keeper this process uses for ``identity`` (Redis address and key settings).

    A forked child gets keepers of its own: its parent's thread did not survive the fork.
    """
    key = (os.getpid(), *identity)
    with _process_keepers_lock:
        keeper = _process_keepers.get(key)
        if keeper is None:
            keeper = _process_keepers[key] = LeaseKeeper(client_factory, settings)
        return keeper
