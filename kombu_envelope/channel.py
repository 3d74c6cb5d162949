"""The kombu channel over Redis Streams.

Publishing: the message adapter decides whether a message is a task. Tasks
are validated, encoded as Envelopes and added to the queue's priority stream
(or its delayed set when ``schedule_time`` is ahead); other messages go to
the queue's ``kombu`` stream. Exchange bindings live in Redis, so routing
agrees across processes.

Consuming: one consumer group per stream, shared by every worker of every
language. A blocking ``XREADGROUP`` on a dedicated connection waits for new
entries; its socket is registered with the event loop. Reads never take more
entries than the prefetch limit allows and serve higher buckets first.
Ack is ``XACK`` + ``XDEL``; reject without requeue moves the entry to the
dead-letter stream; malformed entries go there too, with their raw bytes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections import deque
from time import monotonic
from typing import Any

from kombu.transport import virtual
from redis.exceptions import RedisError, ResponseError

from kombu_envelope.adapter import MessageAdapter, Undeliverable
from kombu_envelope.codec import F_BODY, F_ENCODING, decode_entry
from kombu_envelope.deadletter import Failure, FailureClass, dead_letter_pending
from kombu_envelope.envelope import Envelope, format_rfc3339, utcnow
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.keys import QueueKeys, bucket_for
from kombu_envelope.publisher import Publisher
from kombu_envelope.scripts import script
from kombu_envelope.settings import Settings

logger = logging.getLogger(__name__)

#: Field of a ``kombu`` stream entry holding the kombu message as JSON.
F_KOMBU = "kombu"
#: Separator of the members of an exchange's binding set.
BINDING_SEP = "\x06"
#: delivery_info keys that locate the stream entry of a delivered message.
INFO_STREAM = "envelope_stream"
INFO_ENTRY_ID = "envelope_entry_id"
#: delivery_info key a consumer may set before reject() to name the failure class.
INFO_FAILURE_CLASS = "envelope_failure_class"
INFO_FAILURE_REASON = "envelope_failure_reason"
#: delivery_info keys naming the consumer that read the entry and the entry's queue.
INFO_CONSUMER = "envelope_consumer"
INFO_QUEUE = "envelope_queue"

_TRANSIENT_ARGUMENTS = ("x-expires", "x-message-ttl")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class QoS(virtual.QoS):
    """Prefetch accounting; ack, reject and restore act on the stream entries."""

    def ack(self, delivery_tag: str) -> None:
        message = self._delivered.get(delivery_tag)
        if message is not None:
            self.channel.ack_entry(message.delivery_info)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        message = self._delivered.get(delivery_tag)
        if message is not None:
            if requeue:
                self.channel.requeue_entry(message.delivery_info)
            else:
                self.channel.dead_letter_rejected(message)
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Put every delivered, unacknowledged entry back into its stream at once."""
        self._flush()
        errors = []
        while self._delivered:
            _tag, message = self._delivered.popitem()
            try:
                self.channel.requeue_entry(message.delivery_info)
            except Exception as exc:
                errors.append((exc, message))
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
        try:
            # Fail here when Redis is unreachable, so that Connection.ensure_connection
            # retries (kombu's redis transport does the same).
            self.client.ping()
        except Exception:
            self.client.close()
            raise
        self.adapter: MessageAdapter = transport.adapter
        self.publisher = Publisher(self.client, self.settings)
        self.consumer_name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._no_ack_queues: set[str] = set()
        self._transient: dict[str, bool] = {}
        self._reader: Any = None
        self._reading = False
        #: Messages read by the last blocking read and not delivered yet (see deliver_buffered).
        self._buffer: deque[tuple[str, dict[str, Any]]] = deque()
        self._wait_only = False
        self._registered_liveness = False
        #: exchange -> (read at, bindings); see get_table.
        self._tables: dict[str, tuple[float, list[tuple[str, str, str]]]] = {}
        #: queue -> time until which it is known to have no cancel marks.
        self._no_cancel_marks_until: dict[str, float] = {}
        #: Acks are batched per event-loop turn when a hub drives the channel.
        self.defer_acks = False
        self._pending_acks: list[tuple[str, str]] = []
        transport.poller.add(self)

    # ----------------------------------------------------------------- publish

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        body = self.decode_body(message["body"], message["properties"].get("body_encoding"))
        envelope = self.adapter.to_envelope(message, body, self.settings.limits)
        if envelope is None:
            self._put_kombu(queue, message)
        else:
            self.publisher.publish(queue, envelope)

    def _put_kombu(self, queue: str, message: dict[str, Any]) -> None:
        maxlen = self.settings.transient_maxlen if self._is_transient(queue) else None
        self.client.xadd(
            self.keys.queue(queue).kombu_stream, {F_KOMBU: json.dumps(message)},
            maxlen=maxlen, approximate=True,
        )

    def _is_transient(self, queue: str) -> bool:
        known = self._transient.get(queue)
        if known is None:
            known = self._transient[queue] = bool(
                self.client.hget(self.keys.queue(queue).meta, "transient")
            )
        return known

    # ------------------------------------------------------------ queue admin

    def _new_queue(self, queue: str, auto_delete: bool = False, **kwargs: Any) -> None:
        keys = self.keys.queue(queue)
        pipe = self.client.pipeline(transaction=False)
        for stream in keys.all_streams:
            pipe.xgroup_create(stream, self.settings.consumer_group, id="0", mkstream=True)
        arguments = kwargs.get("arguments") or {}
        transient = auto_delete or any(a in arguments for a in _TRANSIENT_ARGUMENTS)
        if transient:
            pipe.hset(keys.meta, "transient", 1)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, ResponseError) and not str(reply).startswith("BUSYGROUP"):
                raise reply
        self._transient[queue] = transient or self._transient.get(queue, False)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self.client.exists(*self.keys.queue(queue).all_streams))

    def _size(self, queue: str) -> int:
        """Entries waiting to be read (neither delivered nor delayed)."""
        keys = self.keys.queue(queue)
        pipe = self.client.pipeline(transaction=False)
        for stream in keys.all_streams:
            pipe.xlen(stream)
            pipe.xpending(stream, self.settings.consumer_group)
        replies = pipe.execute(raise_on_error=False)
        size = 0
        for length, pending in zip(replies[::2], replies[1::2]):
            if isinstance(length, int):
                size += length - (pending["pending"] if isinstance(pending, dict) else 0)
        return size

    def _purge(self, queue: str) -> int:
        """Delete entries nobody has read yet, and delayed tasks; return how many."""
        keys = self.keys.queue(queue)
        purger = f"purge-{uuid.uuid4().hex[:8]}"
        read = script(self.client, "read")
        purged = 0
        while True:
            reply = read(keys=list(keys.all_streams),
                         args=[self.settings.consumer_group, purger, 1000])
            if not reply:
                break
            pipe = self.client.pipeline(transaction=True)
            for stream, entries in reply:
                ids = [entry_id for entry_id, _ in entries]
                pipe.xack(stream, self.settings.consumer_group, *ids)
                pipe.xdel(stream, *ids)
                purged += len(ids)
            pipe.execute()
        pipe = self.client.pipeline(transaction=True)
        pipe.zcard(keys.delayed)
        pipe.delete(keys.delayed, keys.delayed_data)
        for stream in keys.all_streams:
            pipe.xgroup_delconsumer(stream, self.settings.consumer_group, purger)
        purged += pipe.execute(raise_on_error=False)[0]
        return purged

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue's bindings and every key of the queue."""
        if if_empty and self._size(queue):
            return
        super().queue_delete(queue, if_unused=if_unused, if_empty=if_empty, **kwargs)
        keys = self.keys.queue(queue)
        self.client.delete(*keys.all_streams, keys.delayed, keys.delayed_data, keys.meta,
                           keys.cancelled)
        self._transient.pop(queue, None)

    def _delete(self, queue: str, exchange: str, routing_key: str, pattern: str | None,
                *args: Any, **kwargs: Any) -> None:
        self._tables.pop(exchange, None)
        self.client.srem(self.keys.binding(exchange), self._binding_member(
            routing_key, pattern, queue))

    # --------------------------------------------------------------- bindings

    @staticmethod
    def _binding_member(routing_key: str, pattern: str | None, queue: str) -> str:
        return BINDING_SEP.join((routing_key or "", pattern or "", queue))

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None,
                    queue: str) -> None:
        self._tables.pop(exchange, None)
        self.client.sadd(self.keys.binding(exchange),
                         self._binding_member(routing_key, pattern, queue))

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

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        """Bindings of ``exchange`` as (routing_key, pattern, queue), shared via Redis.

        Read again at most every ``binding_cache_ms``; :meth:`_lookup` reads it
        again at once when a routing key matches nothing.
        """
        cached = self._tables.get(exchange)
        now = monotonic()
        if cached is not None and now - cached[0] < self.settings.binding_cache_ms / 1000:
            return cached[1]
        table = []
        for member in self.client.smembers(self.keys.binding(exchange)):
            routing_key, pattern, queue = _text(member).split(BINDING_SEP)
            table.append((routing_key, pattern, queue))
        self._tables[exchange] = (now, table)
        return table

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> Any:
        queues = super()._lookup(exchange, routing_key, default)
        if not queues and self._tables.pop(exchange, None) is not None:
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
        self._register_liveness()
        return result

    def _give_back_buffered(self, queue: str) -> None:
        """Put back the entries of ``queue`` read but never delivered (nobody consumes it)."""
        given = [message for name, message in self._buffer if name == queue]
        if not given:
            return
        self._buffer = deque(item for item in self._buffer if item[0] != queue)
        try:
            for message in given:
                self.requeue_entry(message["properties"]["delivery_info"])
        except RedisError:  # they stay pending here: taken over once the lease runs out
            logger.warning("could not give back %d entries of %s read but not delivered",
                           len(given), queue, exc_info=True)

    def _register_liveness(self) -> None:
        if self.closed:  # cancelled while closing, or after (connection is None then)
            return
        lease = self.connection.lease_keeper
        if self._active_queues:
            lease.register(self.consumer_name, self._active_queues)
            self._registered_liveness = True

    @property
    def consuming(self) -> bool:
        """True when this channel has queues to read and prefetch credit left."""
        return bool(self._active_queues) and self.qos.can_consume()

    def _credit(self) -> int:
        return max(self._room(), 1)

    def _room(self) -> int:
        """How many more entries the prefetch limit lets this channel read now."""
        estimate = self.qos.can_consume_max_estimate()
        room = self.settings.max_batch if estimate is None else int(estimate)
        return room - len(self._buffer)

    def _consumed_streams(self) -> list[str]:
        return [s for q in self._active_queues for s in self.keys.queue(q).all_streams]

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """basic_get: take one entry of ``queue`` without blocking."""
        self._register_liveness_for_get()
        while True:
            reply = self._read_now(list(self.keys.queue(queue).all_streams), 1)
            if not reply:
                raise virtual.base.Empty()
            messages = self._messages_from_reply(reply)
            if messages:
                return messages[0][1]

    def _register_liveness_for_get(self) -> None:
        if not self._registered_liveness:
            self.connection.lease_keeper.register(self.consumer_name, self._active_queues)
            self._registered_liveness = True

    def _read_now(self, streams: list[str], count: int) -> list[Any]:
        """Non-blocking read of up to ``count`` entries, most urgent stream first."""
        read = script(self.client, "read")
        args = [self.settings.consumer_group, self.consumer_name, count]
        try:
            return read(keys=streams, args=args)
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            self._recreate_groups()
            return read(keys=streams, args=args)

    def _recreate_groups(self) -> None:
        """After Redis lost its data (restart without persistence), declare groups again."""
        logger.warning("consumer groups missing (was Redis restarted?); creating them again")
        for queue in set(self._active_queues):
            self._new_queue(queue)

    # Blocking reads, driven by the transport's poller.

    @property
    def reader(self) -> Any:
        """Dedicated connection for blocking reads; its socket goes to the event loop."""
        if self._reader is None:
            self._reader = self.client.connection_pool.make_connection()
            self._reader.connect()
        return self._reader

    def start_blocking_read(self) -> int | None:
        """Send a blocking read unless one is in flight; return the socket's fd.

        XREADGROUP takes up to COUNT entries from *each* stream. When the
        prefetch credit is smaller than the number of streams, exactly
        ``credit`` entries are first taken, most urgent first, by read.lua;
        only when there are none is a blocking XREAD sent, from the group's
        last-delivered ids: it waits for unread entries without taking any.
        """
        if not self._reading:
            if not self.consuming or self._buffer:
                return None
            streams = self._consumed_streams()
            credit = self._credit()
            self._wait_only = credit < len(streams)
            if self._wait_only:
                self._buffer.extend(self._messages_from_reply(self._read_now(streams, credit)))
                if self._buffer:
                    return None  # delivered from the buffer, without waiting
                self.reader.send_command(
                    "XREAD", "COUNT", 1, "BLOCK", self.settings.block_ms,
                    "STREAMS", *streams, *self._last_delivered_ids(streams),
                )
            else:
                self.reader.send_command(
                    "XREADGROUP", "GROUP", self.settings.consumer_group, self.consumer_name,
                    "COUNT", credit // len(streams), "BLOCK", self.settings.block_ms,
                    "STREAMS", *streams, *([">"] * len(streams)),
                )
            self._reading = True
        sock = self._reader._sock if self._reader is not None else None
        return sock.fileno() if sock is not None else None

    def finish_blocking_read(self) -> int:
        """Read the reply of the blocking read and deliver its first message (the others
        wait in the buffer); return messages delivered."""
        self._reading = False
        try:
            reply = self.reader.read_response()
        except ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            self._recreate_groups()
            return 0
        except BaseException:
            self._drop_reader()
            raise
        if self._wait_only:  # the reply only says that unread entries exist
            if not self.consuming:
                return 0
            self._buffer.extend(self._messages_from_reply(
                self._read_now(self._consumed_streams(), self._credit())))
            return self.deliver_buffered()
        self._buffer.extend(self._messages_from_reply(reply or []))
        if self._buffer and self.consuming and self._room() > 0:
            self._buffer.extend(self._messages_from_reply(
                self._read_now(self._consumed_streams(), self._room())))
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
                    if _text(group["name"]) == self.settings.consumer_group:
                        last = _text(group["last-delivered-id"])
            ids.append(last)
        return ids

    def _drop_reader(self) -> None:
        if self._reader is not None:
            self._reader.disconnect()
            self._reader = None
        self._reading = False

    def _deliver_message(self, queue: str, message: dict[str, Any]) -> None:
        self.connection._deliver(message, queue)
        if queue in self._no_ack_queues:
            self.ack_entry(message["properties"]["delivery_info"])

    def _messages_from_reply(self, reply: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        """Turn read entries into kombu messages (section 5.1 of docs/protocol.md)."""
        decoded = []
        for stream_name, entries in reply:
            stream = _text(stream_name)
            queue = self.connection.queue_of_stream(stream)
            for entry_id, fields in entries:
                if fields is not None:
                    item = self._decode_entry(queue, stream, _text(entry_id), fields)
                    if item is not None:
                        decoded.append(item)
        cancelled = self._cancelled_among(decoded)
        messages = []
        for queue, stream, entry_id, fields, envelope in decoded:
            if envelope is not None and envelope.task_id in cancelled.get(queue, ()):
                self._skip_cancelled(queue, stream, entry_id, envelope)
                continue
            message = self._message_for(queue, stream, entry_id, fields, envelope)
            if message is not None:
                messages.append((queue, message))
        return messages

    def _decode_entry(self, queue: str, stream: str, entry_id: str, fields: Any
                      ) -> tuple[str, str, str, dict[Any, Any], Envelope | None] | None:
        """Decode one entry; malformed and not-yet-due ones are dealt with here (None)."""
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2]))
        keys = self.keys.queue(queue)
        if stream == keys.kombu_stream:
            return queue, stream, entry_id, fields, None
        try:
            envelope = decode_entry(fields, self.settings.limits)
        except MalformedEntry as exc:
            self._dead_letter(queue, stream, entry_id,
                              Failure(FailureClass.MALFORMED_ENTRY, exc.reason))
            return None
        if not envelope.is_due():
            self._reschedule(queue, keys, stream, entry_id, envelope, fields)
            return None
        return queue, stream, entry_id, fields, envelope

    def _cancelled_among(self, decoded: list[Any]) -> dict[str, set[str]]:
        """Task ids of ``decoded`` marked cancelled, per queue (one round trip).

        A queue found without marks is trusted to have none for ``cancel_check_ms``.
        """
        by_queue: dict[str, list[str]] = {}
        now = monotonic()
        for queue, _stream, _id, _fields, envelope in decoded:
            if envelope is not None and self._no_cancel_marks_until.get(queue, 0) <= now:
                by_queue.setdefault(queue, []).append(envelope.task_id)
        if not by_queue:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for queue, task_ids in by_queue.items():
            pipe.exists(self.keys.queue(queue).cancelled)
            pipe.zmscore(self.keys.queue(queue).cancelled, task_ids)
        replies = pipe.execute()
        cancelled = {}
        for (queue, task_ids), has_marks, marks in zip(by_queue.items(), replies[::2],
                                                       replies[1::2]):
            if not has_marks:
                self._no_cancel_marks_until[queue] = now + self.settings.cancel_check_ms / 1000
            cancelled[queue] = {tid for tid, mark in zip(task_ids, marks) if mark is not None}
        return cancelled

    def _skip_cancelled(self, queue: str, stream: str, entry_id: str,
                        envelope: Envelope) -> None:
        """Acknowledge a cancelled task without running it, and clear its mark."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(stream, self.settings.consumer_group, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.zrem(self.keys.queue(queue).cancelled, envelope.task_id)
        pipe.execute()
        logger.info("task %s (%s) was cancelled; acknowledged without running it",
                    envelope.task_id, envelope.task_type)

    def _message_for(self, queue: str, stream: str, entry_id: str, fields: dict[Any, Any],
                     envelope: Envelope | None) -> dict[str, Any] | None:
        """The kombu message for a decoded entry (None when it was dead-lettered)."""
        try:
            if envelope is None:
                message = self._kombu_message(fields)
            else:
                message = self.adapter.to_message(envelope, queue)
        except MalformedEntry as exc:
            self._dead_letter(queue, stream, entry_id,
                              Failure(FailureClass.MALFORMED_ENTRY, exc.reason))
            return None
        except Undeliverable as exc:
            assert envelope is not None
            self._dead_letter(queue, stream, entry_id,
                              Failure(FailureClass(exc.failure_class), exc.reason,
                                      task_id=envelope.task_id, task_type=envelope.task_type))
            return None
        properties = message.setdefault("properties", {})
        properties["delivery_tag"] = f"{stream} {entry_id}"
        info = properties.setdefault("delivery_info", {})
        info.setdefault("exchange", "")
        info.setdefault("routing_key", queue)
        info.update({INFO_STREAM: stream, INFO_ENTRY_ID: entry_id,
                     INFO_CONSUMER: self.consumer_name, INFO_QUEUE: queue,
                     "redelivered": b"n" in fields or "n" in fields})
        return message

    @staticmethod
    def _kombu_message(fields: dict[Any, Any]) -> dict[str, Any]:
        raw = fields.get(F_KOMBU.encode(), fields.get(F_KOMBU))
        if raw is None:
            raise MalformedEntry("kombu stream entry has no 'kombu' field")
        try:
            message = json.loads(raw)
        except ValueError as exc:
            raise MalformedEntry(f"kombu stream entry is not JSON: {exc}") from exc
        if not isinstance(message, dict) or not isinstance(message.get("properties"), dict):
            raise MalformedEntry("kombu stream entry is not a kombu message")
        return message

    def _reschedule(self, queue: str, keys: QueueKeys, stream: str, entry_id: str,
                    envelope: Envelope, fields: dict[Any, Any]) -> None:
        """An entry added to a stream before it is due goes to the delayed set instead.

        Not a transaction: a crash after scheduling leaves the entry pending, and
        scheduling it again once taken over replaces the same task_id.
        """
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.keys.queues, queue)
        script(self.client, "schedule")(
            keys=[keys.delayed, keys.delayed_data],
            args=[envelope.task_id, envelope.due_ms(), bucket_for(envelope.priority).value,
                  fields.get(F_ENCODING.encode(), fields.get(F_ENCODING)),
                  fields.get(F_BODY.encode(), fields.get(F_BODY)),
                  self.keys.wakeup_channel],
            client=pipe,
        )
        pipe.xack(stream, self.settings.consumer_group, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    # ------------------------------------------------------- ack / reject

    def ack_entry(self, delivery_info: dict[str, Any]) -> None:
        """Acknowledge and delete the entry a message came from.

        Under an event loop the ack waits for :meth:`flush_acks`, which the
        transport calls on every turn: one round trip for all the acks of a turn.
        """
        stream = delivery_info.get(INFO_STREAM)
        if stream is None:
            return
        self._pending_acks.append((stream, delivery_info[INFO_ENTRY_ID]))
        if not self.defer_acks:
            self.flush_acks()

    def flush_acks(self) -> None:
        """XACK and XDEL every acknowledged entry not yet settled, in one transaction."""
        if not self._pending_acks:
            return
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in self._pending_acks:
            by_stream.setdefault(stream, []).append(entry_id)
        self._pending_acks = []
        pipe = self.client.pipeline(transaction=True)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.settings.consumer_group, *ids)
            pipe.xdel(stream, *ids)
        replies = pipe.execute()
        for (stream, ids), acked in zip(by_stream.items(), replies[::2]):
            if acked < len(ids):
                # Normal when a task settled its entry itself (dead-lettered it); the
                # takeover of a consumer that only looked dead is logged by the taker.
                logger.info(
                    "%d of %d entries of %s were already settled when acknowledged "
                    "(dead-lettered by their task, or taken over while this consumer "
                    "looked dead)", len(ids) - acked, len(ids), stream)

    def requeue_entry(self, delivery_info: dict[str, Any]) -> None:
        """Put the entry a message came from back at the end of its stream."""
        stream = delivery_info.get(INFO_STREAM)
        if stream is None:
            return
        queue = self.connection.queue_of_stream(stream)
        script(self.client, "requeue")(
            keys=[stream, stream, self.keys.queue(queue).dead],
            args=[self.settings.consumer_group, delivery_info[INFO_ENTRY_ID], "", 0, 0, 0,
                  format_rfc3339(utcnow())],
        )

    def dead_letter_rejected(self, message: Any) -> None:
        """reject(requeue=False): the entry goes to the dead-letter stream, never nowhere."""
        info = message.delivery_info
        stream = info.get(INFO_STREAM)
        if stream is None:
            return
        failure_class = FailureClass(info.get(INFO_FAILURE_CLASS, FailureClass.REJECTED))
        reason = info.get(INFO_FAILURE_REASON, "rejected by the consumer without requeue")
        self._dead_letter(self.connection.queue_of_stream(stream), stream,
                          info[INFO_ENTRY_ID], Failure(failure_class, reason))

    def _dead_letter(self, queue: str, stream: str, entry_id: str, failure: Failure) -> None:
        dead_id = dead_letter_pending(
            self.client, self.settings, queue=queue, stream=stream, entry_id=entry_id,
            failure=failure, consumer=self.consumer_name,
        )
        if dead_id is None:
            logger.info("entry %s of %s was already settled (dead-lettered by its task); "
                        "not dead-lettered again", entry_id, stream)
            return
        logger.error("entry %s of %s dead-lettered as %s (%s): %s", entry_id, stream,
                     dead_id, failure.failure_class.value, failure.reason)

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        if self.closed:
            return
        transport = self.connection
        queues = set(self._active_queues)
        self.flush_acks()
        super().close()  # cancels consumers and restores what QoS tracked
        self._buffer.clear()  # given back when their consumers were cancelled above
        self._drop_reader()
        transport.poller.discard(self)
        try:
            if self._registered_liveness:
                self._requeue_own_pending(queues)
        finally:
            # Even when Redis is unreachable: stop renewing this consumer, so that its
            # liveness key expires and other consumers take back what it still holds.
            if self._registered_liveness:
                transport.lease_keeper.unregister(self.consumer_name)
            self.client.close()

    def _requeue_own_pending(self, queues: set[str]) -> None:
        """Entries read but never delivered (a read in flight at close) go back at once."""
        requeue = script(self.client, "requeue")
        now = format_rfc3339(utcnow())
        for queue in queues:
            keys = self.keys.queue(queue)
            for stream in keys.all_streams:
                pending = self.client.xpending_range(
                    stream, self.settings.consumer_group, min="-", max="+", count=10_000,
                    consumername=self.consumer_name,
                )
                for item in pending:
                    requeue(keys=[stream, stream, keys.dead],
                            args=[self.settings.consumer_group, _text(item["message_id"]),
                                  self.consumer_name, 0, 0, 0, now])
