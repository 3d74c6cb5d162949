"""Publishing Envelopes: validate, encode, then add to a stream or the delayed set.

Usable without kombu::

    from redis import Redis
    from kombu_envelope import Envelope, Publisher

    Publisher(Redis()).publish("orders", Envelope.new(task_type="order.close_timeout",
                                                      payload={"order_id": 1}))

:meth:`Publisher.publish_many` publishes a list in one round trip (all or nothing when one
is invalid); :meth:`Publisher.publish_iter` draws Envelopes from a loop that builds them
while Redis stores the ones before.
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
from kombu_envelope.store.task_records import (
    RecordSpecs,
    RecordWrite,
    TaskState,
    envelope_fields,
    record_write,
)
from kombu_envelope.trace_context import SendSpan, send_span_maker, send_spans

#: A ``publish_many`` writes its steps this many at a time while it builds the rest, so
#: that Redis runs the first ones meanwhile (one Redis; a Cluster batch goes at the end).
FLUSH_EVERY = 100
#: A ``publish_iter`` reads its replies this many Envelopes at a time (a multiple of
#: :data:`FLUSH_EVERY`): one Batch, and one moment "now", per chunk.
ITER_CHUNK = 1000


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
            _end_spans(spans, exc)
            raise
        _end_spans(spans)
        return replies

    def publish_iter(self, items: Iterable[tuple[str, Envelope]]) -> list[str | None]:
        """Publish Envelopes as ``items`` makes them, while Redis stores the ones before.

        Meant for a loop that builds its Envelopes::

            publisher.publish_iter((queue, Envelope.new(task_type=..., payload=row))
                                   for row in rows)

        Each Envelope is checked and encoded when it is drawn, written to Redis
        :data:`FLUSH_EVERY` at a time, and the replies are read :data:`ITER_CHUNK` at a time,
        one chunk in flight: Redis stores the first Envelopes while the next are built
        (with :meth:`publish_many` it waits while the whole list is built), one Redis in
        the order they are drawn. Returns what :meth:`publish_many` returns, in order, and
        gives each Envelope its trace headers and ``send`` span alike.

        Unlike :meth:`publish_many`, a bad Envelope cannot hold back the ones before it.
        When anything raises (an Envelope that breaks a publish-time rule, as
        :class:`~kombu_envelope.errors.InvalidEnvelope` naming it; ``items`` itself; a
        Redis error reading a chunk's replies), nothing more is drawn, the Envelopes drawn
        before are still sent and their replies read, and the error propagates (or the
        error sending them, when that fails too).
        """
        ids: list[str | None] = []
        token = random_hex(8)  # for every try of this call, as in publish_many
        registered: set[str] = set()
        new_span = send_span_maker()
        drawing: _Chunk | None = None  # being drawn; written FLUSH_EVERY at a time
        in_flight: _Chunk | None = None  # written whole, its replies not read yet
        try:
            for queue, envelope in items:
                if drawing is None:
                    drawing = _Chunk(self)
                span = new_span(queue, envelope.task_id, envelope.task_type)
                try:
                    step = drawing.steps.prepare(queue, envelope, span)
                except BaseException as exc:
                    span.end(exc)  # refused: its span ends now, marked ERROR
                    raise
                if _Steps.needs_registry(step) and queue not in registered:
                    # Listed before its data lands (section 2): a round trip of its own.
                    self.client.sadd(self.settings.keys.queues, queue)
                    registered.add(queue)
                drawing.steps.add(drawing.batch, step, token)
                size = len(drawing.steps.spans)
                if size % FLUSH_EVERY == 0:
                    if in_flight is not None:  # read first: one chunk in flight, in order
                        done, in_flight = in_flight, None
                        ids += done.finish()
                    drawing.batch.flush()
                if size == ITER_CHUNK:
                    in_flight, drawing = drawing, None
        except BaseException:
            _finish_in_order(in_flight, drawing)  # what was drawn is still published
            raise
        return ids + _finish_in_order(in_flight, drawing)

    def _send(self, items: list[tuple[str, Envelope]], spans: list[SendSpan], now: datetime,
              tokens: Sequence[str] | None, checked: bool) -> list[str | None]:
        steps = _Steps(self, now, checked)
        prepared = [steps.prepare(queue, envelope, span)
                    for (queue, envelope), span in zip(items, spans)]
        # Delayed and keyed tasks' queues are registered, so promoters serve them (a
        # keyed task's successor is released by a promoter: section 20).
        delayed_queues = sorted({step[0].queue for step in prepared
                                 if steps.needs_registry(step)})
        # One token for every try of this call: a try repeated after a lost reply
        # (kombu_envelope.store.outages) is absorbed by the scripts.
        if tokens is None:
            tokens = [random_hex(8)] * len(prepared)
        elif len(tokens) != len(prepared):
            raise ValueError(f"{len(tokens)} publish tokens for {len(prepared)} Envelopes")
        # A single publish too: a Batch sends EVALSHA straight on a connection (redis-py's
        # pipelines would send SCRIPT EXISTS first, and its Script objects pack each argument
        # in Python), and ends with WAIT with wait_replicas.
        batch = Batch(self.client, self.settings, "publish")
        if delayed_queues:
            # Registered on every delayed publish, before schedule.lua wakes the
            # promoters (a SADD of its own: the registry is in another slot): a registry
            # lost with a Redis restart is rebuilt by the next publish.
            for queue in delayed_queues:
                batch.first("sadd", self.settings.keys.queues, queue)
        try:
            for index, (step, token) in enumerate(zip(prepared, tokens), 1):
                steps.add(batch, step, token)
                if index % FLUSH_EVERY == 0:
                    batch.flush()  # Redis runs these while the next ones are built
            return _entry_ids(batch.execute())
        finally:
            batch.close()

    def _check(self, envelope: Envelope, now: datetime | None) -> None:
        """Raise InvalidEnvelope unless ``envelope`` may be published now."""
        check_publishable(envelope, self.settings.limits, now)
        self.schemas.check(envelope)


#: A step of a publish: the queue's keys, the Envelope, whether it is due, and its
#: encoding and body.
_Prepared = tuple[QueueKeys, Envelope, bool, str, bytes]


class _Steps:
    """The steps of Envelopes published at one moment ``now``: each checked (unless
    ``checked``), encoded, then queued on a :class:`Batch` as its queue's script."""

    def __init__(self, publisher: Publisher, now: datetime, checked: bool = False) -> None:
        self.publisher = publisher
        self.settings = settings = publisher.settings
        self.now = now
        self.checked = checked
        self.records = RecordSpecs(settings, now)
        self.spans: list[SendSpan] = []
        self._queue_keys: dict[str, QueueKeys] = {}

    def prepare(self, queue: str, envelope: Envelope, span: SendSpan) -> _Prepared:
        """Check and encode ``envelope`` (raises InvalidEnvelope); ``span`` writes its
        trace headers and, once the Envelope is ready to send, is kept to be ended with
        the call."""
        keys = self._queue_keys.get(queue)
        if keys is None:  # an invalid queue name also sends nothing
            keys = self._queue_keys[queue] = self.settings.keys.queue(queue)
        span.write_headers(envelope.headers)  # published, so validated, with the rest
        if not self.checked:
            self.publisher._check(envelope, self.now)
        settings = self.settings
        step = (keys, envelope, envelope.is_due(self.now),
                *encode_body(envelope, settings.gzip_min_bytes, limits=settings.limits))
        self.spans.append(span)
        return step

    @staticmethod
    def needs_registry(step: _Prepared) -> bool:
        """Whether the step's queue must be in the registry first: a delayed or keyed task."""
        _, envelope, due, _, _ = step
        return not due or envelope.ordering_key is not None

    def enqueue_step(self, step: _Prepared, token: str) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV of enqueue.lua for a due task."""
        keys, envelope, _, enc, body = step
        record_keys, record_args = _queued_record(self.records, keys, envelope)
        return ([keys.stream(bucket_for(envelope.priority)), keys.delayed, keys.delayed_data,
                 keys.published(envelope.task_id), *record_keys],
                [envelope.task_id, enc, body, token, self.settings.publish_dedupe_ms,
                 *record_args])

    def add(self, batch: Batch, step: _Prepared, token: str) -> None:
        """Queue the step's script on ``batch``: enqueue.lua when due, else schedule.lua."""
        keys, envelope, due, enc, body = step
        if due:
            batch.script("enqueue", *self.enqueue_step(step, token))
        else:
            schedule_encoded(batch, self.settings, keys, envelope, enc, body, token=token,
                             now=self.now)


class _Chunk:
    """Envelopes of a ``publish_iter`` published together: one moment "now", one Batch."""

    def __init__(self, publisher: Publisher) -> None:
        self.steps = _Steps(publisher, utcnow())
        self.batch = Batch(publisher.client, publisher.settings, "publish")

    def finish(self) -> list[str | None]:
        """Send what is not written yet, read every reply and end the spans."""
        try:
            ids = _entry_ids(self.batch.execute())
        except BaseException as exc:
            _end_spans(self.steps.spans, exc)
            raise
        finally:
            self.batch.close()
        _end_spans(self.steps.spans)
        return ids

    def drop(self, error: BaseException) -> None:
        """Publish nothing more of this chunk (an earlier one failed): end its spans."""
        self.batch.close()
        _end_spans(self.steps.spans, error)


def _finish_in_order(*chunks: _Chunk | None) -> list[str | None]:
    """Finish ``chunks`` in order; when one fails, drop the ones after it and raise."""
    ids: list[str | None] = []
    for index, chunk in enumerate(chunks):
        if chunk is None:
            continue
        try:
            ids += chunk.finish()
        except BaseException as exc:
            for later in chunks[index + 1:]:
                if later is not None:
                    later.drop(exc)
            raise
    return ids


def _end_spans(spans: list[SendSpan], error: BaseException | None = None) -> None:
    """End the send spans of a call; ``error``: its publish failed."""
    for span in spans:
        span.end(error)


def _entry_ids(replies: list[Any]) -> list[str | None]:
    """enqueue.lua answers the entry id (or "waiting"); schedule.lua answers an integer."""
    return [
        reply.decode() if isinstance(reply, bytes) else reply if isinstance(reply, str)
        else None
        for reply in replies
    ]


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
