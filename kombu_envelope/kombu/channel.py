"""The kombu channel over Redis Streams.

Publishing: the message adapter decides whether a message is a task. Tasks
are validated, encoded as Envelopes and added to the queue's priority stream
(or its delayed set when ``schedule_time`` is ahead), or written to the
transactional outbox when one is in use (:mod:`kombu_envelope.outbox`); other
messages go to the queue's ``kombu`` stream. Exchange bindings live in Redis, so routing
agrees across processes.

Consuming: one consumer group per stream, shared by every worker of every
language. A blocking ``XREADGROUP`` on a dedicated connection waits for new
entries; its socket is registered with the event loop. Reads never take more
entries than the prefetch limit allows and serve higher buckets first.
Ack is ``XACK`` + ``XDEL``; reject without requeue moves the entry to the
dead-letter stream; malformed entries go there too, with their raw bytes.

This module is the kombu glue and the read mechanics; the Redis side lives in
:mod:`~kombu_envelope.store.queues`, :mod:`~kombu_envelope.kombu.bindings`,
:mod:`~kombu_envelope.kombu.inbox` (entries to messages) and
:mod:`~kombu_envelope.kombu.settle` (ack, requeue, dead-letter).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections import deque
from dataclasses import replace
from time import monotonic
from typing import Any

from kombu.transport import virtual
from redis.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from kombu_envelope.envelope import utcnow
from kombu_envelope.kombu.adapter import MessageAdapter
from kombu_envelope.kombu.bindings import BINDING_SEP, Binding, Bindings
from kombu_envelope.kombu.delivery_info import (
    INFO_CONSUMER,
    INFO_ENTRY_ID,
    INFO_FAILURE_CLASS,
    INFO_FAILURE_REASON,
    INFO_ORDER,
    INFO_QUEUE,
    INFO_SLOT,
    INFO_STREAM,
    INFO_TASK_ID,
)
from kombu_envelope.kombu.inbox import F_KOMBU, Inbox
from kombu_envelope.kombu.readers import QueueReader
from kombu_envelope.kombu.settle import Settler
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import WorkerAnnouncement
from kombu_envelope.store.cluster import CLUSTER_REDIRECTS, forget_slot_owner
from kombu_envelope.store.ordering import held_member
from kombu_envelope.store.outages import is_outage, retries_seen
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.queues import Queues
from kombu_envelope.store.replacing import pending_replaced_by
from kombu_envelope.store.replication import run_script
from kombu_envelope.store.replies import as_text

__all__ = [
    "BINDING_SEP", "F_KOMBU", "INFO_CONSUMER", "INFO_ENTRY_ID", "INFO_FAILURE_CLASS",
    "INFO_FAILURE_REASON", "INFO_QUEUE", "INFO_STREAM", "Channel", "QoS",
]

logger = logging.getLogger(__name__)


class QoS(virtual.QoS):
    """Prefetch accounting; ack, reject and restore act on the stream entries.

    When the channel closes, messages still being run (the transport's
    ``keeps_running``) are kept rather than put back: :attr:`kept` holds them
    until they are settled, and the channel's consumer stays alive until then.
    """

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        #: Messages still running when the channel closed, by delivery tag.
        self.kept: dict[str, Any] = {}

    def _settling(self, delivery_tag: str) -> Any:
        """The message of ``delivery_tag``, delivered or kept (None if settled)."""
        message = self._delivered.get(delivery_tag)
        return message if message is not None else self.kept.get(delivery_tag)

    def _settled(self, delivery_tag: str) -> None:
        if self.kept.pop(delivery_tag, None) is not None:
            self.channel.settler.flush_acks()  # a closed channel has no event loop turns
            if not self.kept:
                self.channel.release_kept()

    def ack(self, delivery_tag: str) -> None:
        message = self._settling(delivery_tag)
        if message is not None:
            self.channel.settler.ack(message.delivery_info)
        super().ack(delivery_tag)
        self._settled(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        message = self._settling(delivery_tag)
        if message is not None:
            if requeue:
                self.channel.settler.requeue(message.delivery_info)
            else:
                self.channel.settler.dead_letter_rejected(message.delivery_info)
        self._quick_ack(delivery_tag)
        self._settled(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Put every delivered, unacknowledged entry that is not running back at once."""
        self._flush()
        errors = []
        while self._delivered:
            tag, message = self._delivered.popitem()
            if self.channel.keeps_running(message):
                self.kept[tag] = message
                continue
            try:
                self.channel.settler.requeue(message.delivery_info)
            except Exception as exc:
                errors.append((exc, message))
        if self.kept:
            logger.warning("channel closed while %d delivered tasks still run; their entries "
                           "stay with consumer %s until they are settled", len(self.kept),
                           self.channel.consumer_name)
        return errors


class Channel(virtual.Channel):
    """A kombu channel whose queues are Redis Streams holding Envelopes."""

    QoS = QoS
    do_restore = True
    supports_fanout = True  # every binding is stored in Redis, fanout included

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        transport = self.connection
        self.settings: Settings = transport.settings
        self.keys = self.settings.keys
        self.client = transport.new_redis_client()
        self._on_cluster = isinstance(self.client, RedisCluster)
        try:
            # Fail here when Redis is unreachable, so that Connection.ensure_connection
            # retries (kombu's redis transport does the same).
            self.client.ping()
        except Exception:
            if not self._on_cluster:  # a Cluster client is the transport's, shared
                self.client.close()
            raise
        self.adapter: MessageAdapter = transport.adapter
        self.publisher = Publisher(self.client, self.settings)
        self.lease_keeper = transport.lease_keeper
        self.keeps_running = transport.keeps_running
        self.consumer_name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._no_ack_queues: set[str] = set()
        #: The blocking read of each consumed queue.
        self._readers: dict[str, QueueReader] = {}
        #: Set when a Cluster reader lost its node: the poller comes back soon.
        self.retry_reads_soon = False
        #: Messages read by the last blocking read and not delivered yet (see deliver_buffered).
        self._buffer: deque[tuple[str, dict[str, Any]]] = deque()
        #: Queues whose last read took all it asked for: they may hold more right now.
        self._may_hold_more: set[str] = set()
        #: Queues with limits (docs/protocol.md, section 19), as their last read said:
        #: their entries are taken only by read.lua, never by a blocking XREADGROUP.
        self._limited: set[str] = set()
        #: Queues a read.lua answer told about limits yet; until then they are waited on
        #: as limited queues (an XREAD that takes nothing).
        self._limits_known: set[str] = set()
        #: Per queue with parked entries: read it again by then (monotonic seconds).
        self._read_again_at: dict[str, float] = {}
        #: Per queue with entries waiting for a slot: the id after which its slot-freed
        #: stream says a slot freed (the wait on the queue includes that stream).
        self._freed_after: dict[str, str] = {}
        self._registered_liveness = False
        self._started_at = utcnow()
        self.queues = Queues(self.client, self.settings)
        self.bindings = Bindings(self.client, self.settings)
        self.settler = Settler(self.client, self.settings, self.consumer_name,
                               transport.queue_of_stream, self._holds)
        self.inbox = Inbox(self.client, self.settings, self.adapter, self.consumer_name,
                           transport.queue_of_stream, self.settler, self._limited)
        self.start_capacity = transport.start_capacity
        self.settler.runner_frees_slots = transport.runner_frees_slots()
        transport.poller.add(self)

    def _holds(self, delivery_tag: str) -> bool:
        """Whether the message of ``delivery_tag`` was delivered here and is not settled."""
        qos = self.qos
        return delivery_tag in qos._delivered or delivery_tag in qos.kept

    # ----------------------------------------------------------------- publish

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        body = self.decode_body(message["body"], message["properties"].get("body_encoding"))
        envelope = self.adapter.to_envelope(message, body, self.settings.limits)
        if envelope is None:
            self._put_kombu(queue, message)
            return
        sink = self.connection.outbox_sink()
        if sink is not None and pending_replaced_by(queue, envelope) is None:
            sink.write(queue, envelope)  # the next attempt of a running task is never diverted
        else:
            self.publisher.publish(queue, envelope)

    def _put_kombu(self, queue: str, message: dict[str, Any]) -> None:
        maxlen = self.settings.transient_maxlen if self.queues.is_transient(queue) else None
        self.client.xadd(
            self.keys.queue(queue).kombu_stream, {F_KOMBU: json.dumps(message)},
            maxlen=maxlen, approximate=True,
        )

    # ------------------------------------------------------------ queue admin

    def _new_queue(self, queue: str, auto_delete: bool = False, **kwargs: Any) -> None:
        self.queues.declare(queue, auto_delete, kwargs.get("arguments"))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.queues.exists(queue)

    def _size(self, queue: str) -> int:
        return self.queues.size(queue)

    def _purge(self, queue: str) -> int:
        return self.queues.purge(queue)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue's bindings and every key of the queue."""
        if if_empty and self._size(queue):
            return
        super().queue_delete(queue, if_unused=if_unused, if_empty=if_empty, **kwargs)
        self.queues.delete(queue)

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str | None,
                *args: Any, **kwargs: Any) -> None:
        self.bindings.remove(exchange, routing_key, pattern, queue)

    # --------------------------------------------------------------- bindings

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None,
                    queue: str) -> None:
        self.bindings.add(exchange, routing_key, pattern, queue)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: dict[str, Any] | None = None, **kwargs: Any) -> None:
        exchange = exchange or "amq.direct"
        self.state.binding_delete(queue, exchange, routing_key)
        meta = self.typeof(exchange).prepare_bind(queue, exchange, routing_key, arguments)
        self._delete(queue, exchange, *meta)

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        for queue in self._lookup(exchange, routing_key):
            self._put(queue, message, **kwargs)

    def get_table(self, exchange: str) -> list[Binding]:
        """Bindings of ``exchange`` as (routing_key, pattern, queue), shared via Redis.

        A direct exchange's table is read again at most every ``binding_cache_ms``
        (:meth:`_lookup` reads it again at once when a routing key matches nothing);
        a topic or fanout exchange's on every call.
        """
        return self.bindings.table(exchange, cached_ok=self.typeof(exchange).type == "direct")

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> Any:
        queues = super()._lookup(exchange, routing_key, default)
        if not queues and self.bindings.forget(exchange):
            queues = super()._lookup(exchange, routing_key, default)  # a binding may be new
        return queues

    # -------------------------------------------------------------- consuming

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        result = super().basic_consume(queue, no_ack, *args, **kwargs)
        self._register_liveness()
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._no_ack_queues.discard(queue)
            self._give_back_buffered(queue)
        self._register_liveness(announce=False)
        return result

    def _give_back_buffered(self, queue: str) -> None:
        """Put back the entries of ``queue`` read but never delivered (nobody consumes it)."""
        given = [message for name, message in self._buffer if name == queue]
        if not given:
            return
        self._buffer = deque(item for item in self._buffer if item[0] != queue)
        try:
            for message in given:
                self.settler.requeue(message["properties"]["delivery_info"])
        except RedisError:  # they stay pending here: taken over once the lease runs out
            logger.warning("could not give back %d entries of %s read but not delivered",
                           len(given), queue, exc_info=True)

    def _register_liveness(self, announce: bool = True) -> None:
        """Keep this consumer alive for the queues it consumes, and announce the task
        queues among them (not transient ones: replies, events, remote control). A
        cancel (``announce`` False) keeps the last announcement: its queues stay
        recently served, and a stopping worker cancels them all before it says it
        stopped."""
        if self.closed:  # cancelled while closing, or after
            return
        if self._active_queues:
            announced = [queue for queue in self._active_queues
                         if not self.queues.is_transient(queue)] if announce else []
            transport = self.connection
            announcement = replace(
                WorkerAnnouncement.of_this_process(
                    self.consumer_name, announced, transport.served_tasks(),
                    transport.concurrency()),
                started_at=self._started_at) if announced else None
            self.lease_keeper.register(self.consumer_name, self._active_queues, announcement,
                                       slots=self._held_slots)
            self._registered_liveness = True

    @property
    def consuming(self) -> bool:
        """True when this channel has queues to read and prefetch credit left."""
        return bool(self._active_queues) and self.qos.can_consume()

    def _room(self) -> int:
        """How many more entries the prefetch limit lets this channel read now: the
        credit left, less what waits in the buffer and what reads in flight may take."""
        estimate = self.qos.can_consume_max_estimate()
        room = self.settings.max_batch if estimate is None else int(estimate)
        reserved = sum(reader.reserved for reader in self._readers.values())
        return room - len(self._buffer) - reserved

    def _consumed_queues(self) -> list[str]:
        """The queues consumed, in consume order (Celery's ``-Q`` order), once each."""
        return list(dict.fromkeys(self._active_queues))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """basic_get: take one entry of ``queue`` without blocking."""
        self._register_liveness_for_get()
        while True:
            reply = self._read_now(queue, 1)
            if not reply:
                raise virtual.base.Empty()
            messages = self.inbox.messages(reply)
            if messages:
                return messages[0][1]

    def _register_liveness_for_get(self) -> None:
        if not self._registered_liveness:
            self.lease_keeper.register(self.consumer_name, self._active_queues,
                                       slots=self._held_slots)
            self._registered_liveness = True

    def _read_queues(self, credit: int) -> list[tuple[str, dict[str, Any]]]:
        """Take up to ``credit`` entries without blocking: one read.lua per queue, in
        consume order, each with the credit the earlier queues left."""
        messages: list[tuple[str, dict[str, Any]]] = []
        for queue in self._consumed_queues():
            if credit <= 0:
                break
            reply = self._read_now(queue, credit)
            credit -= sum(len(entries) for _stream, entries in reply)
            messages.extend(self.inbox.messages(reply))
        return messages

    def _read_now(self, queue: str, count: int) -> list[Any]:
        """Non-blocking read of up to ``count`` entries of ``queue``, most urgent first."""
        streams = list(self.keys.queue(queue).all_streams)
        args: list[str | int] = [self.settings.consumer_group, self.consumer_name, count,
                                 self.settings.lease_ms, self._limited_credit(count)]
        retried = retries_seen()
        try:  # settings None: no WAIT after a read, as before
            answer: list[Any] = run_script(self.client, None, "read", streams, args, "read")
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            self._recreate_groups()
            answer = run_script(self.client, None, "read", streams, args, "read")
        reply = self._note_limits(queue, answer)
        self._note_fill(queue, sum(len(entries) for _stream, entries in reply) >= count)
        if retries_seen() != retried:
            reply = reply + self._unseen_own_entries(streams, reply)
        return self._without_held(reply)

    def _limited_credit(self, count: int) -> int:
        """How many entries of limited task types a read may take: what the process can
        start now (its pool's free capacity, when known), less what waits read already."""
        capacity = self.start_capacity()
        return count if capacity is None else max(0, min(count, capacity - len(self._buffer)))

    def _note_limits(self, queue: str, answer: list[Any]) -> list[Any]:
        """The entries of a read.lua answer, remembering whether ``queue`` has limits and
        when its parked entries want it read again and whether they wait for a slot
        (docs/protocol.md, section 19)."""
        reply, wait_ms, limited, freed_after = answer
        if freed_after:
            self._freed_after[queue] = as_text(freed_after)
        else:
            self._freed_after.pop(queue, None)
        self._limits_known.add(queue)
        if limited:
            self._limited.add(queue)
        else:
            self._limited.discard(queue)
        if wait_ms >= 0:
            self._read_again_at[queue] = monotonic() + wait_ms / 1000
        else:
            self._read_again_at.pop(queue, None)
        return reply

    def _held_slots(self) -> list[tuple[str, str]]:
        """(running key, member) of every concurrency slot this channel may hold: its
        delivered, unsettled messages of limited queues and the tasks the process still
        runs after acknowledging them (the lease keeper renews them); and the
        ``order-held`` members of those with an ordering key."""
        for _ in range(3):  # the event loop may change the dict meanwhile: look again
            try:
                infos = [message.delivery_info for message in list(self.qos._delivered.values())]
                break
            except RuntimeError:
                continue
        else:
            infos = []
        infos += self.connection.running_deliveries()
        own = [info for info in infos if info.get(INFO_CONSUMER) == self.consumer_name]
        slots = [(info[INFO_SLOT], f"{info[INFO_STREAM]} {info[INFO_ENTRY_ID]}")
                 for info in own if INFO_SLOT in info]
        # The ordering keys held by runs acknowledged early (section 20) renew alike.
        holds = [(self.keys.queue(info[INFO_QUEUE]).order_held,
                  held_member(info[INFO_ORDER], info[INFO_TASK_ID], info[INFO_STREAM],
                              info[INFO_ENTRY_ID]))
                 for info in own if INFO_ORDER in info and INFO_TASK_ID in info]
        return list(dict.fromkeys(slots + holds))

    def _note_fill(self, queue: str, filled: bool) -> None:
        """Remember whether the last read of ``queue`` took all it asked for."""
        if filled:
            self._may_hold_more.add(queue)
        else:
            self._may_hold_more.discard(queue)

    def _unseen_own_entries(self, streams: list[str], reply: list[Any]) -> list[Any]:
        """Entries this consumer holds but never saw: a read retried after its reply
        was lost may have taken them (kombu_envelope.store.outages)."""
        self.settler.settle_acks()  # an entry whose ack is on its way is not unseen
        known = {(as_text(stream), as_text(entry_id))
                 for stream, entries in reply for entry_id, _ in entries}
        known.update(self._held_entries())
        try:
            held = self.client.xreadgroup(self.settings.consumer_group, self.consumer_name,
                                          dict.fromkeys(streams, "0"))
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            self._recreate_groups()  # Redis lost its data: nothing is held any more
            return []
        unseen = []
        for stream, entries in held or []:
            entries = [(entry_id, fields) for entry_id, fields in entries
                       if fields and (as_text(stream), as_text(entry_id)) not in known]
            if entries:
                unseen.append([stream, entries])
        if unseen:
            logger.warning("recovered %d entries whose read reply was lost",
                           sum(len(entries) for _, entries in unseen))
        return unseen

    def _held_entries(self) -> set[tuple[str, str]]:
        """(stream, entry id) of every message this channel delivered and has not
        settled, or read and not delivered yet."""
        infos = [message.delivery_info for message in self.qos._delivered.values()]
        infos += [message["properties"]["delivery_info"] for _queue, message in self._buffer]
        return {(info[INFO_STREAM], info[INFO_ENTRY_ID]) for info in infos
                if INFO_STREAM in info}

    def _without_held(self, reply: list[Any]) -> list[Any]:
        """``reply`` without the entries this channel holds already.

        Redis replicates asynchronously: a primary that fails right after serving a
        read may leave a replica that never saw it, and once promoted it hands the
        same entries out again, to this consumer too, while they still run here.
        """
        held = self._held_entries()
        if not held:
            return reply
        kept, dropped = [], 0
        for stream, entries in reply:
            fresh = [(entry_id, fields) for entry_id, fields in entries
                     if (as_text(stream), as_text(entry_id)) not in held]
            dropped += len(entries) - len(fresh)
            if fresh:
                kept.append([stream, fresh])
        if dropped:
            logger.warning("read %d entries this consumer already holds (a failover lost "
                           "the read that gave them); not delivered twice", dropped)
        return kept

    def _recreate_groups(self) -> None:
        """After Redis lost its data (restart without persistence), declare groups again."""
        logger.warning("consumer groups missing (was Redis restarted?); creating them again")
        for queue in set(self._active_queues):
            self._new_queue(queue)

    # Blocking reads, one per queue (kombu_envelope.kombu.readers), driven by the
    # transport's poller.

    def start_blocking_reads(self) -> list[tuple[int, QueueReader]]:
        """Send a blocking read on every consumed queue that has none in flight; return
        (fd, reader) for every read in flight.

        XREADGROUP takes up to COUNT entries from *each* stream, so the credit left
        is shared among the queues that start a read, each taking at most its share.
        A queue whose share is smaller than its number of streams waits with a
        blocking XREAD from the group's last-delivered ids instead, which takes
        nothing; its reply makes the channel take exactly the credit with read.lua.
        When the last read of such a queue took all it asked for, read.lua is tried
        first: a queue being drained needs no wait, nor the ids to wait from.

        A reader whose last reply was lost with its connection first recovers the
        entries that read may have taken (this consumer's own, never delivered).
        """
        queues = self._consumed_queues()
        for gone in set(self._readers) - set(queues):
            self._readers.pop(gone).drop()
        if self.consuming and not self._buffer:
            for reader in self._readers.values():
                if reader.reply_lost and not reader.reading:
                    reader.reply_lost = False
                    streams = list(reader.streams)
                    self._buffer.extend(self.inbox.messages(
                        self._unseen_own_entries(streams, [])))
        if self.consuming and not self._buffer:
            idle = [queue for queue in queues
                    if queue not in self._readers or not self._readers[queue].reading]
            room = self._room()
            share = room // len(idle) if idle else 0
            # Too little credit for every queue: one entry each for the first ones.
            for queue in idle if share else idle[:max(room, 0)]:
                if not self._took_without_waiting(queue, max(share, 1)):
                    self._start_read(queue, max(share, 1))
        return [(fd, reader) for reader in self._readers.values()
                if (fd := reader.fileno()) is not None]

    def _took_without_waiting(self, queue: str, share: int) -> bool:
        """Buffer up to ``share`` entries of a queue that may hold more when its share
        would only let it wait; True when that read brought messages to deliver."""
        if share >= len(self.keys.queue(queue).all_streams) or queue not in self._may_hold_more:
            return False
        messages = self.inbox.messages(self._read_now(queue, share))
        self._buffer.extend(messages)
        return bool(messages)

    def _start_read(self, queue: str, share: int) -> None:
        streams = self.keys.queue(queue).all_streams
        reader = self._readers.get(queue)
        if reader is None:
            reader = self._readers[queue] = QueueReader(queue, streams)
        count = share // len(streams)
        try:
            if count < 1 or queue in self._limited or queue not in self._limits_known:
                waited = list(streams)
                ids = self._last_delivered_ids(waited)
                if queue in self._freed_after:
                    waited.append(self.keys.queue(queue).slot_freed)
                    ids.append(self._freed_after[queue])
                command: tuple[Any, ...] = (
                    "XREAD", "COUNT", 1, "BLOCK", self._block_ms(queue),
                    "STREAMS", *waited, *ids)
                reserved, wait_only = 0, True
            else:
                command = ("XREADGROUP", "GROUP", self.settings.consumer_group,
                           self.consumer_name, "COUNT", count, "BLOCK", self.settings.block_ms,
                           "STREAMS", *streams, *([">"] * len(streams)))
                reserved, wait_only = count * len(streams), False
            self._send_blocking_read(reader, command, reserved, wait_only)
        except Exception as exc:
            if not self._on_cluster or not (is_outage(exc) or isinstance(exc, CLUSTER_REDIRECTS)):
                raise
            self._lost_slot_owner(reader, exc)

    def _block_ms(self, queue: str) -> int:
        """How long a wait on ``queue`` may block: ``block_ms``, or until its parked
        entries want it read again."""
        again = self._read_again_at.get(queue)
        if again is None:
            return self.settings.block_ms
        return max(1, min(self.settings.block_ms, int((again - monotonic()) * 1000)))

    def _send_blocking_read(self, reader: QueueReader, command: tuple[Any, ...],
                            reserved: int, wait_only: bool) -> None:
        """Send ``command`` on ``reader``, on a new connection if the reader's broke
        since its last reply (connecting waits for Redis up to outage_tolerance_s;
        behind Sentinel it asks the sentinels where the primary is now)."""
        try:
            reader.send(self.client, *command, reserved=reserved, wait_only=wait_only)
        except Exception as exc:
            if not is_outage(exc) or self._on_cluster:
                raise  # on a Cluster, _start_read reads the slot map again first
            reader.drop()
            reader.send(self.client, *command, reserved=reserved, wait_only=wait_only)

    def _lost_slot_owner(self, reader: QueueReader, exc: BaseException) -> None:
        """A Cluster node stopped serving ``reader``'s queue (it failed over, the slot
        moved, or it is unreachable): read the slot map again; the read is sent again
        to the slot's owner on the next turn."""
        logger.warning("blocking read of %s lost its node (%s); reading again from the "
                       "node that serves its slot", reader.queue, exc)
        reader.drop()
        forget_slot_owner(self.client)
        self.retry_reads_soon = True

    def finish_blocking_read(self, reader: QueueReader) -> int:
        """Read the reply of ``reader``'s blocking read and deliver its first message (the
        others wait in the buffer); return messages delivered.

        A failover never stops consuming: a redirect or failover reply took nothing, so
        the read is sent again on a new connection (to the slot's new owner on a
        Cluster, to the primary the sentinels name behind Sentinel); a connection that
        broke or timed out may have lost a reply that took entries, so the reader
        first recovers this consumer's unseen entries (see start_blocking_reads).
        """
        wait_only, per_stream = reader.wait_only, reader.reserved // len(reader.streams)
        try:
            reply = reader.reply()
        except ResponseError as exc:
            if str(exc).startswith("NOGROUP"):
                self._recreate_groups()
                return 0
            if isinstance(exc, CLUSTER_REDIRECTS) and self._on_cluster:
                self._lost_slot_owner(reader, exc)
                return 0
            reader.drop()
            if not is_outage(exc):
                raise
            # UNBLOCKED (a stream read was deleted, or the server changed role) or a
            # failover reply: nothing was taken; read again on a new connection, which
            # finds the primary again (Sentinel asks the sentinels).
            logger.info("blocking read ended by Redis (%s); reading again (queue %s)",
                        exc, reader.queue)
            if self._on_cluster:
                forget_slot_owner(self.client)
                self.retry_reads_soon = True
            return 0
        except BaseException as exc:
            reader.drop()
            if not is_outage(exc):
                raise
            # The connection broke or timed out (a failover, a restart): the read may
            # have taken entries whose reply is lost. Read again on a new connection
            # (connecting waits for Redis up to outage_tolerance_s, then fails to the
            # event loop), starting with this consumer's own unseen entries.
            reader.reply_lost = True
            if self._on_cluster:
                self._lost_slot_owner(reader, exc)
            else:
                logger.warning("blocking read lost its connection (%s); reading again on a "
                               "new one (queue %s)", exc, reader.queue)
            return 0
        if wait_only:  # the reply only says that unread entries exist
            if not self.consuming:
                return 0
            self._buffer.extend(self._read_queues(self._room()))
            return self.deliver_buffered()
        self._buffer.extend(self.inbox.messages(self._without_held(reply or [])))
        self._note_fill(reader.queue, _filled(reply, per_stream))
        if reader.queue in self._may_hold_more and self.consuming and self._room() > 0:
            # A stream gave all the read asked of it, so the queue may hold more: top
            # the buffer up from it alone (the other queues have their own reads in
            # flight). A reply short on every stream drained them when Redis sent it.
            self._buffer.extend(self.inbox.messages(self._read_now(reader.queue,
                                                                   self._room())))
        return self.deliver_buffered()

    def has_buffered(self) -> bool:
        """Whether a message read earlier waits and the prefetch limit lets it go."""
        return bool(self._buffer) and self.qos.can_consume()

    def deliver_buffered(self) -> int:
        """Deliver one message read earlier; return how many were delivered (0 or 1).

        One per turn of the event loop: a Celery worker runs a solo-pool task inside
        the delivery, and checks between turns whether it was told to stop. Delivering
        a whole batch at once would make a warm shutdown run every prefetched task
        instead of giving them back. The entries stay pending under this consumer;
        cancelling the consumer (closing does) puts back whatever was never delivered.
        """
        if not self.has_buffered():
            return 0
        queue, message = self._buffer.popleft()
        self._deliver_message(queue, message)
        return 1

    def _last_delivered_ids(self, streams: list[str]) -> list[str]:
        """The consumer group's last-delivered id on each stream ("0-0" when unknown)."""
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        ids = []
        for groups in pipe.execute(raise_on_error=False):
            last = "0-0"  # no stream or no group yet: any entry is unread
            if not isinstance(groups, Exception):
                for group in groups:
                    if as_text(group["name"]) == self.settings.consumer_group:
                        last = as_text(group["last-delivered-id"])
            ids.append(last)
        return ids

    def _drop_readers(self) -> None:
        for reader in self._readers.values():
            reader.drop()
        self._readers.clear()

    def _deliver_message(self, queue: str, message: dict[str, Any]) -> None:
        self.connection._deliver(message, queue)
        if queue in self._no_ack_queues:
            self.settler.ack(message["properties"]["delivery_info"])

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        if self.closed:
            return
        transport = self.connection
        self._closed_queues = set(self._active_queues)
        self.settler.flush_acks()
        super().close()  # cancels consumers and restores what QoS tracked
        self._buffer.clear()  # given back when their consumers were cancelled above
        self._drop_readers()
        transport.poller.discard(self)
        if not self.qos.kept:
            self.release_kept()

    def release_kept(self) -> None:
        """The channel is closed and none of its messages runs any more: give back what
        its consumer still holds, stop keeping it alive and close the client."""
        try:
            if self._registered_liveness:
                # Entries read but never delivered (a read in flight) go back at once.
                self.settler.requeue_own_pending(self._closed_queues)
        except RedisError:
            logger.warning("could not give back the entries consumer %s still holds; they "
                           "go back once its lease runs out", self.consumer_name, exc_info=True)
        finally:
            # Even when Redis is unreachable: stop renewing this consumer, so that its
            # liveness key expires and other consumers take back what it still holds.
            if self._registered_liveness:
                self.lease_keeper.unregister(self.consumer_name)
            if not self._on_cluster:  # a Cluster client is the transport's, shared
                self.client.close()


def _filled(reply: list[Any] | None, per_stream: int) -> bool:
    """Whether a blocking read's reply took its full COUNT from one of its streams."""
    return any(len(entries) >= per_stream for _stream, entries in reply or [])
