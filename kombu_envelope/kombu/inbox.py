"""Read stream entries become kombu messages (section 5.1 of docs/protocol.md).

Malformed entries, tasks the message adapter cannot deliver, and payloads that
break their schema (``invalid_payload``, checked after the adapter) are
dead-lettered; tasks added before they are due go to their delayed set; tasks
marked cancelled (in ``<prefix>:cancelled``) or expired are not run: the
adapter either delivers them to a consumer that records them as revoked
(Celery) or they are acknowledged here. Every other entry becomes a kombu
message whose delivery_info locates the entry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from time import monotonic
from typing import Any

from redis.exceptions import RedisError

from kombu_envelope.codec import F_BODY, F_ENCODING, F_REDELIVERIES, F_REQUEUES, decode_entry
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import QueueKeys
from kombu_envelope.kombu.adapter import MessageAdapter, NotRun, Undeliverable
from kombu_envelope.kombu.delivery_info import (
    INFO_CONSUMER,
    INFO_DUE_MS,
    INFO_ENTRY_ID,
    INFO_ORDER,
    INFO_QUEUE,
    INFO_SKIPPED,
    INFO_SLOT,
    INFO_STREAM,
    INFO_TASK_ID,
    INFO_TASK_TYPE,
)
from kombu_envelope.kombu.settle import Settler
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.publisher import schedule_encoded
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.schemas import PayloadSchemas, dead_letter_reason
from kombu_envelope.store.task_records import skip_write

#: Everything a channel does is logged under one name.
logger = logging.getLogger("kombu_envelope.kombu.channel")

#: Field of a ``kombu`` stream entry holding the kombu message as JSON.
F_KOMBU = "kombu"

#: A decoded entry: queue, stream, entry id, fields, and its Envelope (None in a kombu stream).
Decoded = tuple[str, str, str, dict[Any, Any], Envelope | None]


class Inbox:
    """Turns the entries one consumer reads into the kombu messages it delivers."""

    def __init__(self, client: Any, settings: Settings, adapter: MessageAdapter,
                 consumer_name: str, queue_of_stream: Callable[[str], str],
                 settler: Settler, limited: set[str] | None = None) -> None:
        """``limited``: the queues with limits (section 19), kept by the channel."""
        self.client = client
        self.settings = settings
        self.keys = settings.keys
        self.adapter = adapter
        self.consumer_name = consumer_name
        self.queue_of_stream = queue_of_stream
        self.settler = settler
        self.limited = limited if limited is not None else set()
        self.schemas = PayloadSchemas(client, settings)
        #: Time until which ``<prefix>:cancelled`` is known not to exist.
        self._no_cancel_marks_until = 0.0

    def messages(self, reply: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        """(queue, kombu message) for each entry of a read reply that is to be delivered."""
        decoded = []
        for stream_name, entries in reply:
            stream = as_text(stream_name)
            queue = self.queue_of_stream(stream)
            for entry_id, fields in entries:
                if fields is not None:
                    item = self._decode_entry(queue, stream, as_text(entry_id), fields)
                    if item is not None:
                        decoded.append(item)
        cancelled = self._cancelled_among(decoded)
        now = utcnow()
        messages = []
        for queue, stream, entry_id, fields, envelope in decoded:
            if envelope is not None and envelope.task_id in cancelled:
                message = self._not_run(queue, stream, entry_id, fields, envelope,
                                        NotRun.REVOKED)
            elif envelope is not None and envelope.is_expired(now):
                message = self._not_run(queue, stream, entry_id, fields, envelope,
                                        NotRun.EXPIRED)
            else:
                message = self._message_for(queue, stream, entry_id, fields, envelope)
            if message is not None:
                messages.append((queue, message))
        return messages

    def _decode_entry(self, queue: str, stream: str, entry_id: str, fields: Any
                      ) -> Decoded | None:
        """Decode one entry; malformed and not-yet-due ones are dealt with here (None)."""
        if isinstance(fields, list):
            fields = dict(zip(fields[::2], fields[1::2]))
        keys = self.keys.queue(queue)
        if stream == keys.kombu_stream:
            return queue, stream, entry_id, fields, None
        try:
            envelope = decode_entry(fields, self.settings.limits)
        except MalformedEntry as exc:
            self.settler.dead_letter(queue, stream, entry_id,
                                     Failure(FailureClass.MALFORMED_ENTRY, exc.reason))
            return None
        if not envelope.is_due():
            self._reschedule(queue, keys, stream, entry_id, envelope, fields)
            return None
        return queue, stream, entry_id, fields, envelope

    def _cancelled_among(self, decoded: list[Decoded]) -> set[str]:
        """Task ids of ``decoded`` marked cancelled (one round trip; marks stay).

        While ``<prefix>:cancelled`` does not exist it is trusted not to for
        ``cancel_check_ms``. A failed lookup runs the tasks: cancelling is best
        effort once a task is in a stream.
        """
        now = monotonic()
        task_ids = [envelope.task_id for *_, envelope in decoded if envelope is not None]
        if not task_ids or self._no_cancel_marks_until > now:
            return set()
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.cancelled)
        pipe.zmscore(self.keys.cancelled, task_ids)
        try:
            has_marks, marks = pipe.execute()
        except RedisError as exc:
            logger.warning("looking up cancel marks failed (%r); running %d tasks unchecked",
                           exc, len(task_ids))
            return set()
        if not has_marks:
            self._no_cancel_marks_until = now + self.settings.cancel_check_ms / 1000
        return {task_id for task_id, mark in zip(task_ids, marks) if mark is not None}

    def _not_run(self, queue: str, stream: str, entry_id: str, fields: dict[Any, Any],
                 envelope: Envelope, why: NotRun) -> dict[str, Any] | None:
        """A task that must not run: delivered to be recorded so, or acknowledged here."""
        reason = "cancelled" if why is NotRun.REVOKED else "expired"
        message = self.adapter.to_not_run_message(envelope, queue, why)
        if message is not None:
            logger.info("task %s (%s) was %s; delivered to be recorded as not run",
                        envelope.task_id, envelope.task_type, why.value)
            located = self._located(message, queue, stream, entry_id, fields, envelope)
            located["properties"]["delivery_info"][INFO_SKIPPED] = reason
            return located
        self.settler.ack_now(stream, [entry_id],
                             [skip_write(self.settings, queue, envelope.task_id, reason)])
        logger.info("task %s (%s) was %s; acknowledged without running it",
                    envelope.task_id, envelope.task_type, why.value)
        return None

    def _message_for(self, queue: str, stream: str, entry_id: str, fields: dict[Any, Any],
                     envelope: Envelope | None) -> dict[str, Any] | None:
        """The kombu message for a decoded entry (None when it was dead-lettered)."""
        try:
            if envelope is None:
                message = _kombu_message(fields)
            else:
                message = self.adapter.to_message(envelope, queue)
                self._check_payload(envelope)
        except MalformedEntry as exc:
            self.settler.dead_letter(queue, stream, entry_id,
                                     Failure(FailureClass.MALFORMED_ENTRY, exc.reason,
                                             task_id=envelope.task_id if envelope else None))
            return None
        except Undeliverable as exc:
            assert envelope is not None
            self.settler.dead_letter(
                queue, stream, entry_id,
                Failure(FailureClass(exc.failure_class), exc.reason,
                        task_id=envelope.task_id, task_type=envelope.task_type))
            return None
        return self._located(message, queue, stream, entry_id, fields, envelope)

    def _check_payload(self, envelope: Envelope) -> None:
        """Raise Undeliverable (``invalid_payload``) when the payload breaks its schema.

        A failed lookup of the schemas runs the task unchecked (logged).
        """
        try:
            violations = self.schemas.violations(envelope)
        except RedisError as exc:
            logger.warning("reading payload schemas failed (%r); task %s runs unchecked",
                           exc, envelope.task_id)
            return
        if violations:
            reason = dead_letter_reason(violations)
            self.adapter.refused(envelope, FailureClass.INVALID_PAYLOAD.value, reason)
            raise Undeliverable(FailureClass.INVALID_PAYLOAD.value, reason)

    def _located(self, message: dict[str, Any], queue: str, stream: str, entry_id: str,
                 fields: dict[Any, Any], envelope: Envelope | None) -> dict[str, Any]:
        """``message`` with the delivery_info that locates its entry (and its task)."""
        properties = message.setdefault("properties", {})
        properties["delivery_tag"] = f"{stream} {entry_id}"
        info = properties.setdefault("delivery_info", {})
        info.setdefault("exchange", "")
        info.setdefault("routing_key", queue)
        info.update({INFO_STREAM: stream, INFO_ENTRY_ID: entry_id,
                     INFO_CONSUMER: self.consumer_name, INFO_QUEUE: queue,
                     "redelivered": _was_delivered_before(fields)})
        if envelope is not None:
            info[INFO_TASK_ID] = envelope.task_id
            info[INFO_TASK_TYPE] = envelope.task_type
            if queue in self.limited:
                info[INFO_SLOT] = self.keys.queue(queue).running(envelope.task_type)
            if envelope.ordering_key is not None:
                info[INFO_ORDER] = envelope.ordering_key
            due = envelope.schedule_time or envelope.created_at
            info[INFO_DUE_MS] = int(due.timestamp() * 1000)
        return message

    def _reschedule(self, queue: str, keys: QueueKeys, stream: str, entry_id: str,
                    envelope: Envelope, fields: dict[Any, Any]) -> None:
        """An entry added to a stream before it is due goes to the delayed set instead.

        Three steps, each in one slot: the registry's SADD, schedule.lua, then the
        acknowledgement (one MULTI on the stream). A crash between them leaves the
        entry pending, and scheduling it again once it is taken over is absorbed by
        the publish token ``entry:<entry id>``.
        """
        batch = Batch(self.client, self.settings, "reschedule").first(
            "sadd", self.keys.queues, queue)
        schedule_encoded(batch, self.settings, keys, envelope,
                         fields.get(F_ENCODING.encode(), fields.get(F_ENCODING)),
                         fields.get(F_BODY.encode(), fields.get(F_BODY)),
                         token=f"entry:{entry_id}")
        batch.execute()
        slots = ([(keys.running(envelope.task_type), f"{stream} {entry_id}")]
                 if queue in self.limited else [])
        self.settler.ack_now(stream, [entry_id], slots=slots)


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


def _was_delivered_before(fields: dict[Any, Any]) -> bool:
    """True for an entry taken back from a dead consumer or put back by a live one."""
    return any(name in fields or name.encode() in fields
               for name in (F_REDELIVERIES, F_REQUEUES))
