"""Publishing Envelopes: validate, encode, then add to a stream or the delayed set.

Usable without kombu::

    from redis import Redis
    from kombu_envelope import Envelope, Publisher

    Publisher(Redis()).publish("orders", Envelope.new(task_type="order.close_timeout",
                                                      payload={"order_id": 1}))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from kombu_envelope.codec import encode_body
from kombu_envelope.envelope import Envelope, check_publishable, utcnow
from kombu_envelope.keys import QueueKeys, bucket_for
from kombu_envelope.random_ids import random_hex
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.replacing import Replaced, pending_replaced_by, replace_pending
from kombu_envelope.store.schemas import PayloadSchemas
from kombu_envelope.store.scripts import script
from kombu_envelope.store.task_records import (
    RecordSpecs,
    RecordWrite,
    TaskState,
    envelope_fields,
    record_write,
)
from kombu_envelope.trace_context import SendSpan, send_spans

#: A ``publish_many`` writes its steps this many at a time while it builds the rest, so
#: that Redis runs the first ones meanwhile (one Redis; a Cluster batch goes at the end).
FLUSH_EVERY = 100


class Publisher:
    """Stores Envelopes in a queue: its priority stream when due, its delayed set otherwise."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.schemas = PayloadSchemas(client, self.settings)

    def publish(self, queue: str, envelope: Envelope, now: datetime | None = None) -> str | None:
        """Publish one Envelope; return its stream entry id, or None when it was delayed
        or replaced a pending entry.

        Raises :class:`~kombu_envelope.errors.InvalidEnvelope` before anything
        reaches Redis when a publish-time rule is broken or the payload breaks its
        schema (:mod:`kombu_envelope.store.schemas`). The next attempt of a
        task whose entry is pending replaces it (see :mod:`kombu_envelope.store.replacing`).
        """
        pending = pending_replaced_by(queue, envelope)
        if pending is not None:
            self._check(envelope, now)
            outcome = replace_pending(self.client, self.settings, pending, envelope)
            if outcome is Replaced.REPLACED or not pending.publish_if_gone:
                return None
        return self.publish_many([(queue, envelope)], now)[0]

    def publish_many(
        self, items: Iterable[tuple[str, Envelope]], now: datetime | None = None,
        tokens: Sequence[str] | None = None, *, checked: bool = False,
    ) -> list[str | None]:
        """Publish many Envelopes in one pipelined round trip (one per node on a Cluster).

        Each Envelope is its own step: its queue's script, never a MULTI across
        queues (docs/protocol.md, section 2), so the Envelopes of queues on other
        Cluster shards go out together, one pipeline per node (see
        :class:`~kombu_envelope.store.batch.Batch` for how scripts travel in it).

        Every Envelope is validated first (publish-time rules, payload schema); if any
        is invalid nothing is sent.
        Returns, in order, each stream entry id (None for delayed ones).

        Each Envelope gets ``traceparent``/``tracestate`` headers from the current trace
        unless it has them (docs/protocol.md, section 18; they are added to the
        Envelope given), and with OpenTelemetry and a tracer provider its ``send <queue>``
        span.

        ``tokens`` gives each Envelope its publish token (docs/protocol.md, section 4)
        instead of one random token for the call: a caller that derives the token from
        what identifies a publish (the dispatcher: the task id or ``Idempotency-Key``)
        has a second publish of it within ``publish_dedupe_ms`` store nothing.

        ``checked``: the caller applied the publish-time rules and the payload schemas
        to every Envelope a moment ago (the dispatcher does, to answer each task of a
        batch on its own), so they are not applied twice.
        """
        items = list(items)
        spans = send_spans([(queue, envelope.task_id, envelope.task_type)
                            for queue, envelope in items])
        try:
            replies = self._send(items, spans, now or utcnow(), tokens, checked)
        except BaseException as exc:
            for span in spans:
                span.end(exc)
            raise
        for span in spans:
            span.end()
        return replies

    def _send(self, items: list[tuple[str, Envelope]], spans: list[SendSpan], now: datetime,
              tokens: Sequence[str] | None, checked: bool) -> list[str | None]:
        settings = self.settings
        gzip_min_bytes, limits = settings.gzip_min_bytes, settings.limits
        prepared = []
        queue_keys: dict[str, QueueKeys] = {}
        for (queue, envelope), span in zip(items, spans):
            keys = queue_keys.get(queue)
            if keys is None:  # an invalid queue name also sends nothing
                keys = queue_keys[queue] = settings.keys.queue(queue)
            span.write_headers(envelope.headers)  # published, so validated, with the rest
            if not checked:
                self._check(envelope, now)
            prepared.append((keys, envelope, envelope.is_due(now),
                             *encode_body(envelope, gzip_min_bytes, limits=limits)))
        # Delayed and keyed tasks' queues are registered, so promoters serve them (a
        # keyed task's successor is released by a promoter: section 20).
        delayed_queues = sorted({keys.queue for keys, envelope, due, _, _ in prepared
                                 if not due or envelope.ordering_key is not None})
        # One token for every try of this call: a try repeated after a lost reply
        # (kombu_envelope.store.outages) is absorbed by the scripts.
        if tokens is None:
            tokens = [random_hex(8)] * len(prepared)
        elif len(tokens) != len(prepared):
            raise ValueError(f"{len(tokens)} publish tokens for {len(prepared)} Envelopes")
        dedupe_ms = settings.publish_dedupe_ms
        records = RecordSpecs(settings, now)
        if len(prepared) == 1 and not delayed_queues and not settings.wait_replicas:
            # One due task: EVALSHA on its own. Run in a pipeline, redis-py first
            # sends SCRIPT EXISTS, a second round trip on every single publish. With
            # wait_replicas the WAIT must share the script's connection: a Batch, whose
            # raw EVALSHA needs no SCRIPT EXISTS either.
            keys, envelope, _, enc, body = prepared[0]
            record_keys, record_args = _queued_record(records, keys, envelope)
            enqueue = script(self.client, "enqueue")
            reply = enqueue(keys=[keys.stream(bucket_for(envelope.priority)), keys.delayed,
                                  keys.delayed_data, keys.published(envelope.task_id),
                                  *record_keys],
                            args=[envelope.task_id, enc, body, tokens[0], dedupe_ms,
                                  *record_args])
            return [reply.decode() if isinstance(reply, bytes) else reply]
        batch = Batch(self.client, settings, "publish")  # WAIT with wait_replicas
        if delayed_queues:
            # Registered on every delayed publish, before schedule.lua wakes the
            # promoters (a SADD of its own: the registry is in another slot): a registry
            # lost with a Redis restart is rebuilt by the next publish.
            for queue in delayed_queues:
                batch.first("sadd", settings.keys.queues, queue)
        try:
            for index, ((keys, envelope, due, enc, body), token) in enumerate(
                    zip(prepared, tokens), 1):
                if due:
                    record_keys, record_args = _queued_record(records, keys, envelope)
                    batch.script("enqueue", [keys.stream(bucket_for(envelope.priority)),
                                             keys.delayed, keys.delayed_data,
                                             keys.published(envelope.task_id), *record_keys],
                                 [envelope.task_id, enc, body, token, dedupe_ms, *record_args])
                else:
                    schedule_encoded(batch, settings, keys, envelope, enc, body, token=token,
                                     now=now)
                if index % FLUSH_EVERY == 0:
                    batch.flush()  # Redis runs these while the next ones are built
            replies = batch.execute()
        finally:
            batch.close()
        # enqueue.lua answers the entry id; schedule.lua answers an integer.
        return [
            reply.decode() if isinstance(reply, bytes) else reply if isinstance(reply, str)
            else None
            for reply in replies
        ]

    def _check(self, envelope: Envelope, now: datetime | None) -> None:
        """Raise InvalidEnvelope unless ``envelope`` may be published now."""
        check_publishable(envelope, self.settings.limits, now)
        self.schemas.check(envelope)


def publish_record(settings: Settings, queue: str, envelope: Envelope,
                   now: datetime | None = None) -> RecordWrite:
    """The task record of a publish of ``envelope`` (now or for later)."""
    now = now or utcnow()
    due = envelope.is_due(now)
    return record_write(settings, queue, envelope.task_id,
                        TaskState.QUEUED if due else TaskState.SCHEDULED,
                        _published_fields(queue, envelope, now),
                        due_ms=None if due else envelope.due_ms(), now=now)


def _published_fields(queue: str, envelope: Envelope, now: datetime) -> dict[str, Any]:
    return {**envelope_fields(envelope, queue, now), "published_at": now}


def _queued_record(records: RecordSpecs, keys: QueueKeys,
                   envelope: Envelope) -> tuple[list[str], list[str | bytes]]:
    """The record KEYS and ARGV of a publish of a due ``envelope`` at ``records.now``:
    :func:`publish_record`'s write, its spec shared by the tasks of the call alike (the
    fields :func:`envelope_fields` writes for a due task are its queue, type, version and
    retry count)."""
    return records.write(
        keys, envelope.task_id, TaskState.QUEUED,
        (envelope.task_type, envelope.payload_version, envelope.retry_count),
        lambda: _published_fields(keys.queue, envelope, records.now))


def schedule_encoded(batch: Batch, settings: Settings, keys: QueueKeys,
                     envelope: Envelope, enc: Any, body: Any, *, token: str,
                     now: datetime | None = None) -> None:
    """Queue schedule.lua on ``batch`` for an Envelope already encoded as ``enc``/``body``,
    with its task record.

    ``token`` is the publish token (the same for every try of one publish). The
    caller adds the queue to the registry (``SADD <prefix>:queues``) first.
    """
    record = publish_record(settings, keys.queue, envelope, now)
    batch.script("schedule", [keys.delayed, keys.delayed_data, keys.published(envelope.task_id),
                              *record.keys],
                 [envelope.task_id, envelope.due_ms(), bucket_for(envelope.priority).value, enc,
                  body, settings.keys.wakeup_channel, token, settings.publish_dedupe_ms,
                  *record.args])
