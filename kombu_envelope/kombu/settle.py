"""Settling the stream entries of delivered messages: ack, requeue, dead-letter.

Ack is ``XACK`` + ``XDEL``, batched when a hub drives the channel: the acks of the
messages delivered from one read wait until the channel has nothing more to
deliver, or for :data:`ACK_BATCH_S` at most. A hub's acks are then sent without waiting
(:mod:`~kombu_envelope.store.write_behind`, one Redis without ``wait_replicas``), and
their replies read once the next reads started: the loop no longer waits a round trip
for each batch. An ack whose reply was lost is written again when they are read, and
before anything reads this consumer's pending entries (giving them back, recovering a
lost read) or writes about them; an ack that frees a concurrency slot or moves an
ordering key waits, as their readers are woken once it landed. Requeue puts an entry back at the end
of its stream; dead-lettering moves it, with its raw bytes, to the queue's
dead-letter stream. Each writes the task record of its step (docs/protocol.md,
section 14): an ack the record of a task that was skipped (``INFO_SKIPPED``), in
the ack's ``MULTI``; the success of a task that ran is recorded by whoever ran it,
in the ack's ``MULTI`` when that ack still waits in this process
(:func:`record_with_ack`), with the statistics counted so far when they are due to ride
(:meth:`~kombu_envelope.store.worker_stats.StatsBuffer.ride`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any

from redis.exceptions import ResponseError

from kombu_envelope.envelope import format_rfc3339, utcnow
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.kombu.delivery_info import (
    INFO_ENTRY_ID,
    INFO_FAILURE_CLASS,
    INFO_FAILURE_REASON,
    INFO_ORDER,
    INFO_SKIPPED,
    INFO_SLOT,
    INFO_STREAM,
    INFO_TASK_ID,
    INFO_TASK_TYPE,
)
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.dead_letters import dead_letter_pending
from kombu_envelope.store.ordering import add_advance, wake_promoters
from kombu_envelope.store.replication import execute, run_script, write_pipeline
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.slots import free_slot
from kombu_envelope.store.task_records import (
    RecordWrite,
    TaskState,
    entry_record,
    skip_write,
)
from kombu_envelope.store.worker_stats import UNDECODED, process_buffer
from kombu_envelope.store.write_behind import WriteBehind

#: Everything a channel does is logged under one name.
logger = logging.getLogger("kombu_envelope.kombu.channel")

#: Longest time a deferred ack waits for the acks of the next deliveries (seconds).
ACK_BATCH_S = 0.05

#: The settler of each consumer, by process id and consumer name (a forked child
#: inherits its parent's, which it must not use).
_settlers: weakref.WeakValueDictionary[tuple[int, str], Settler] = (
    weakref.WeakValueDictionary())


def record_with_ack(consumer: str, stream: str, entry_id: str, record: RecordWrite) -> bool:
    """Write ``record`` in the ``MULTI`` of the ack of ``entry_id`` when this process
    makes that ack and has not sent it yet: it waits to be flushed, or the message is
    still delivered here (a solo-pool worker acknowledges right after the task). False
    otherwise (the ack went already, or another process makes it): write it yourself."""
    settler = _settlers.get((os.getpid(), consumer))
    return settler is not None and settler.attach_record(stream, entry_id, record)


class Settler:
    """Acknowledges, requeues and dead-letters the entries one consumer has read."""

    def __init__(self, client: Any, settings: Settings, consumer_name: str,
                 queue_of_stream: Callable[[str], str],
                 holds: Callable[[str], bool] = lambda _tag: False) -> None:
        """``holds(delivery_tag)``: whether a message delivered here is not settled yet."""
        self.client = client
        self.holds = holds
        self.settings = settings
        self.consumer_name = consumer_name
        self.queue_of_stream = queue_of_stream
        #: Whether acks wait for flush_acks (an event loop calls it on its turns).
        self.defer_acks = False
        #: Whether the runner of a task frees its concurrency slot (section 19) when the
        #: run ends, so that only acks of entries not run free it here.
        self.runner_frees_slots = False
        self._pending_acks: list[tuple[str, str, RecordWrite]] = []
        #: When the oldest ack in ``_pending_acks`` was made (monotonic seconds).
        self._pending_since = 0.0
        #: (running key, member) of the slots the acks waiting free (section 19).
        self._slots_freed: list[tuple[str, str]] = []
        #: (stream, ordering key, task_id) of the keys the acks waiting move on (section 20).
        self._keys_advanced: list[tuple[str, str, str]] = []
        #: Records to write with acks not made yet, by (stream, entry id).
        self._records_for_ack: dict[tuple[str, str], RecordWrite] = {}
        self._lock = threading.Lock()  # a thread pool's task may attach a record
        #: Where an event loop's acks go without waiting (one Redis, no wait_replicas).
        self._behind = WriteBehind.where_allowed(client, settings)
        _settlers[os.getpid(), consumer_name] = self

    def ack(self, delivery_info: dict[str, Any]) -> None:
        """Acknowledge and delete the entry a message came from.

        With ``defer_acks`` the ack waits for :meth:`flush_acks`: one round trip
        for all the acks of a turn.
        """
        stream = delivery_info.get(INFO_STREAM)
        if stream is None:
            return
        skipped, task_id = delivery_info.get(INFO_SKIPPED), delivery_info.get(INFO_TASK_ID)
        entry_id = delivery_info[INFO_ENTRY_ID]
        record = (skip_write(self.settings, self.queue_of_stream(stream), task_id, skipped)
                  if skipped and task_id else RecordWrite())
        slot = delivery_info.get(INFO_SLOT)
        if slot is not None and (skipped or not self.runner_frees_slots):
            slot_freed = (slot, f"{stream} {entry_id}")
        else:
            slot_freed = None
        # Whoever frees the slot also moves the ordering key on: the runner when the run
        # ends, else this acknowledgement (and always for a task acknowledged unrun).
        order = delivery_info.get(INFO_ORDER)
        advanced = ((stream, order, task_id) if order is not None and task_id is not None
                    and (skipped or not self.runner_frees_slots) else None)
        with self._lock:
            record = self._records_for_ack.pop((stream, entry_id), record)
            if not self._pending_acks:
                self._pending_since = monotonic()
            self._pending_acks.append((stream, entry_id, record))
            if slot_freed is not None:
                self._slots_freed.append(slot_freed)
            if advanced is not None:
                self._keys_advanced.append(advanced)
        if not self.defer_acks:
            self.flush_acks()

    def attach_record(self, stream: str, entry_id: str, record: RecordWrite) -> bool:
        """Write ``record`` with the ack of ``entry_id``, waiting or still to be made
        (see :func:`record_with_ack`); False if this settler sends no such ack."""
        with self._lock:
            for index, (acked_stream, acked_id, waiting) in enumerate(self._pending_acks):
                if acked_id == entry_id and acked_stream == stream and waiting.key is None:
                    self._pending_acks[index] = (stream, entry_id, record)
                    return True
            if self.defer_acks and self.holds(f"{stream} {entry_id}"):
                self._records_for_ack[stream, entry_id] = record
                return True
        return False

    def _forget_record(self, stream: str, entry_id: str) -> None:
        """The entry is settled otherwise than acknowledged: its record is not written."""
        with self._lock:
            self._records_for_ack.pop((stream, entry_id), None)

    def acks_waited(self) -> bool:
        """Whether the oldest waiting ack has waited :data:`ACK_BATCH_S`."""
        return bool(self._pending_acks) and monotonic() - self._pending_since >= ACK_BATCH_S

    def flush_acks(self, *, wait: bool = True) -> None:
        """XACK and XDEL every acknowledged entry not yet settled: one MULTI per queue.

        The entries of one queue share its slot; those of several queues are
        acknowledged in separate transactions (docs/protocol.md, section 5). With
        ``wait`` False (an event loop's turn), acks that free no slot and move no
        ordering key are sent without waiting for their replies, which
        :meth:`settle_acks` reads (``WriteBehind``); else every ack has landed when
        this returns.
        """
        if wait:
            self.settle_acks()
        with self._lock:
            pending, self._pending_acks = self._pending_acks, []
            slots, self._slots_freed = self._slots_freed, []
            advanced, self._keys_advanced = self._keys_advanced, []
        if not pending:
            return
        by_queue: dict[str, tuple[dict[str, list[str]], list[RecordWrite]]] = {}
        for stream, entry_id, record in pending:
            by_stream, records = by_queue.setdefault(self.queue_of_stream(stream), ({}, []))
            by_stream.setdefault(stream, []).append(entry_id)
            if record.key is not None:
                records.append(record)
        for queue, (by_stream, records) in by_queue.items():
            self._ack_in_one_slot(by_stream, records, [
                (key, member) for key, member in slots
                if self.queue_of_stream(member.split(" ", 1)[0]) == queue
            ], [(key, task_id) for stream, key, task_id in advanced
                if self.queue_of_stream(stream) == queue], behind=not wait)
        if advanced:
            wake_promoters(self.client, self.settings)

    def settle_acks(self) -> None:
        """Read the replies of the acks sent without waiting: they landed, or were
        written again, when this returns. Whatever reads this consumer's pending
        entries, or writes about them on another connection, calls it first."""
        if self._behind is not None:
            self._behind.settle()

    def ack_now(self, stream: str, ids: list[str], records: list[RecordWrite] | None = None,
                slots: list[tuple[str, str]] | None = None) -> None:
        """XACK and XDEL entries of one stream at once, in one MULTI with ``records`` and
        the slots they free."""
        self.settle_acks()
        self._ack_in_one_slot({stream: ids}, records or [], slots)

    def _ack_in_one_slot(self, by_stream: dict[str, list[str]],
                         records: list[RecordWrite],
                         slots: list[tuple[str, str]] | None = None,
                         advanced: list[tuple[str, str]] | None = None,
                         behind: bool = False) -> None:
        """One MULTI on the streams of one queue (and the records its acks carry, with
        the statistics counted so far on the queue when they are due to ride, the
        concurrency slots they free: ``slots``, (running key, member), and the ordering
        keys they move on: ``advanced``, (key, task_id)), then ``WAIT``
        with ``wait_replicas`` on the connection that ran it (on a Cluster, to the node
        of the queue's slot). ``behind``: sent without waiting when it frees no slot
        and moves no key (whose readers are woken once it landed)."""
        first = next(iter(by_stream))
        pipe = write_pipeline(self.client, self.settings, transaction=True, key=first)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.settings.consumer_group, *ids)
            pipe.xdel(stream, *ids)
        for record in records:
            record.add_to(pipe)
        for key, member in slots or ():
            free_slot(pipe, key, member)
        if advanced:
            queue_keys = self.settings.keys.queue(self.queue_of_stream(first))
            for key, task_id in advanced:
                add_advance(pipe, queue_keys, key, task_id)
        stats, queue = process_buffer(self.settings), self.queue_of_stream(first)
        counted = stats.ride(pipe, queue) if records else {}

        def write() -> None:
            try:
                replies = execute(pipe, self.settings, "ack")
            except BaseException:
                stats.give_back(queue, counted)
                raise
            self._log_settled_already(by_stream, replies)

        if behind and self._behind is not None and not slots and not advanced:
            # An error reply is written again the usual way, which raises it.
            self._behind.send(pipe, redo=write, failed=lambda _error: write(),
                              landed=lambda replies: self._log_settled_already(by_stream,
                                                                               replies))
        else:
            write()

    @staticmethod
    def _log_settled_already(by_stream: dict[str, list[str]], replies: list[Any]) -> None:
        for (stream, ids), acked in zip(by_stream.items(), replies[:2 * len(by_stream):2]):
            if acked < len(ids):
                # Normal when a task settled its entry itself (dead-lettered it, or
                # replaced it by its next attempt); the takeover of a consumer that
                # only looked dead is logged by the taker.
                logger.info(
                    "%d of %d entries of %s were already settled when acknowledged "
                    "(dead-lettered or retried by their task, or taken over while this "
                    "consumer looked dead)", len(ids) - acked, len(ids), stream)

    def requeue(self, delivery_info: dict[str, Any]) -> None:
        """Put the entry a message came from back at the end of its stream."""
        self.settle_acks()
        stream = delivery_info.get(INFO_STREAM)
        if stream is None:
            return
        queue = self.queue_of_stream(stream)
        entry_id = delivery_info[INFO_ENTRY_ID]
        self._forget_record(stream, entry_id)
        record = entry_record(self.client, self.settings, queue, stream, entry_id,
                              TaskState.QUEUED, task_id=delivery_info.get(INFO_TASK_ID))
        run_script(self.client, self.settings, "requeue",
                   [stream, stream, self.settings.keys.queue(queue).dead, *record.keys],
                   [self.settings.consumer_group, entry_id, "", 0, 0, 0,
                    format_rfc3339(utcnow()), *record.args], "requeue")

    def dead_letter_rejected(self, delivery_info: dict[str, Any]) -> None:
        """reject(requeue=False): the entry goes to the dead-letter stream, never nowhere."""
        stream = delivery_info.get(INFO_STREAM)
        if stream is None:
            return
        self._forget_record(stream, delivery_info[INFO_ENTRY_ID])
        failure_class = FailureClass(delivery_info.get(INFO_FAILURE_CLASS,
                                                       FailureClass.REJECTED))
        reason = delivery_info.get(INFO_FAILURE_REASON,
                                   "rejected by the consumer without requeue")
        self.dead_letter(self.queue_of_stream(stream), stream, delivery_info[INFO_ENTRY_ID],
                         Failure(failure_class, reason,
                                 task_id=delivery_info.get(INFO_TASK_ID),
                                 task_type=delivery_info.get(INFO_TASK_TYPE)))

    def dead_letter(self, queue: str, stream: str, entry_id: str, failure: Failure) -> None:
        """Move a pending entry of ``queue`` to its dead-letter stream, and log it."""
        self.settle_acks()
        dead_id = dead_letter_pending(
            self.client, self.settings, queue=queue, stream=stream, entry_id=entry_id,
            failure=failure, consumer=self.consumer_name,
        )
        if dead_id is None:
            logger.info("entry %s of %s was already settled (dead-lettered by its task); "
                        "not dead-lettered again", entry_id, stream)
            return
        process_buffer(self.settings).count(queue, failure.task_type or UNDECODED, "dead")
        logger.error("entry %s of %s dead-lettered as %s (%s): %s", entry_id, stream,
                     dead_id, failure.failure_class.value, failure.reason)

    def requeue_own_pending(self, queues: Iterable[str]) -> None:
        """Put back at once every entry of ``queues`` this consumer still holds: one
        batch of requeue.lua calls per queue (its slot), ending with ``WAIT`` when
        ``wait_replicas`` is set."""
        self.settle_acks()
        now = format_rfc3339(utcnow())
        for queue in queues:
            keys = self.settings.keys.queue(queue)
            batch = Batch(self.client, self.settings, "requeue")
            for stream in keys.all_streams:
                try:
                    pending = self.client.xpending_range(
                        stream, self.settings.consumer_group, min="-", max="+", count=10_000,
                        consumername=self.consumer_name,
                    )
                except ResponseError as exc:
                    if not str(exc).startswith("NOGROUP"):
                        raise
                    continue  # the queue was deleted (a reply queue): nothing to give back
                for item in pending:
                    entry_id = as_text(item["message_id"])
                    record = entry_record(self.client, self.settings, queue, stream, entry_id,
                                          TaskState.QUEUED)
                    batch.script("requeue", [stream, stream, keys.dead, *record.keys],
                                 [self.settings.consumer_group, entry_id,
                                  self.consumer_name, 0, 0, 0, now, *record.args])
            batch.execute()
