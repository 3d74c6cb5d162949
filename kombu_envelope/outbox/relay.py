"""The relay: committed outbox rows to the streams, in id order, each exactly once.

Each batch is one database transaction::

    SELECT ... FROM envelope_outbox ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED
    -- Publisher.publish_many(rows, tokens=["outbox:<id>", ...])
    DELETE FROM envelope_outbox WHERE id IN (...)
    COMMIT

A row becomes visible to the relay only once the transaction that wrote it has
committed. Several relays share one PostgreSQL outbox: ``SKIP LOCKED`` gives each
its own rows. A relay that dies after publishing and before committing leaves its
rows in place (their locks go with its connection); the next relay publishes them
again with the same tokens, which the scripts absorb within ``publish_dedupe_ms``
(docs/protocol.md, section 4): the task is stored once. Rows are published in id
order within a batch; relays running at once interleave their batches.

SQLite has no ``SKIP LOCKED``: :func:`outbox_engine` begins every transaction with
``BEGIN IMMEDIATE``, so relays there take turns (one relays, the others wait).

A row that can no longer be published (it breaks a payload schema registered since,
or is not an Envelope) is dead-lettered in its queue and deleted with the batch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import Engine, create_engine, delete, event, select
from sqlalchemy.exc import SQLAlchemyError

from kombu_envelope.envelope import Envelope
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.failures import Failure, FailureClass, failure_fields
from kombu_envelope.outbox.lag import OutboxLag, export_lag, measure_lag
from kombu_envelope.outbox.options import (
    DEFAULT_BATCH,
    DEFAULT_IDLE_S,
    DEFAULT_LAG_INTERVAL_S,
    MAX_BACKOFF_S,
)
from kombu_envelope.outbox.table import outbox_table
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import (
    dead_record,
    envelope_dead_fields,
    write_dead_letter,
)
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.task_records import RecordWrite

logger = logging.getLogger(__name__)


def publish_token(row_id: int) -> str:
    """The publish token of outbox row ``row_id``: the same for every relay of it."""
    return f"outbox:{row_id}"


def outbox_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for the relay: connections checked before use (a restarted database is
    reconnected), and on SQLite every transaction begun with ``BEGIN IMMEDIATE``."""
    engine = create_engine(url, pool_pre_ping=True, **kwargs)
    if engine.dialect.name == "sqlite":
        _begin_immediate(engine)
    return engine


def _begin_immediate(engine: Engine) -> None:
    # SQLAlchemy's recipe: let the driver emit no BEGIN of its own, then emit ours.
    @event.listens_for(engine, "connect")
    def _no_driver_begin(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _immediate(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class Relay:
    """Moves committed outbox rows to their queues (see the module's documentation)."""

    def __init__(self, engine: Engine, publisher: Publisher, *, batch: int = DEFAULT_BATCH,
                 idle_s: float = DEFAULT_IDLE_S,
                 lag_interval_s: float = DEFAULT_LAG_INTERVAL_S) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        self.engine = engine
        self.publisher = publisher
        self.batch = batch
        self.idle_s = idle_s
        self.lag_interval_s = lag_interval_s
        self.name = f"outbox-relay-{socket.gethostname()}-{os.getpid()}"
        self._next_lag_at = 0.0

    @property
    def settings(self) -> Settings:
        return self.publisher.settings

    def relay_batch(self) -> int:
        """Relay up to ``batch`` rows in one transaction; return how many."""
        table = outbox_table
        with self.engine.begin() as conn:
            rows = conn.execute(
                select(table.c.id, table.c.queue, table.c.envelope)
                .order_by(table.c.id).limit(self.batch)
                .with_for_update(skip_locked=True)).all()
            if not rows:
                return 0
            self._publish(rows)
            conn.execute(delete(table).where(table.c.id.in_([row.id for row in rows])))
        return len(rows)

    def lag(self) -> OutboxLag:
        """The outbox's current lag."""
        with self.engine.connect() as conn:
            return measure_lag(conn)

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set, waiting out database and Redis outages."""
        backoff = self.idle_s
        while not stop.is_set():
            try:
                moved = self.relay_batch()
                self._report_lag()
            except (SQLAlchemyError, RedisError) as exc:
                logger.warning("outbox relay: %s; trying again in %.1f s", exc, backoff)
                stop.wait(backoff)
                backoff = min(max(backoff, 0.1) * 2, MAX_BACKOFF_S)
                continue
            backoff = self.idle_s
            if moved < self.batch:
                stop.wait(self.idle_s)

    def _publish(self, rows: Sequence[Any]) -> None:
        items: list[tuple[str, Envelope]] = []
        tokens: list[str] = []
        for row in rows:
            try:
                items.append((row.queue, Envelope.parse(row.envelope, self.settings.limits)))
            except InvalidEnvelope as exc:
                self._dead_letter_malformed(row, exc)
                continue
            tokens.append(publish_token(row.id))
        if not items:
            return
        try:
            self.publisher.publish_many(items, tokens=tokens)
        except InvalidEnvelope:  # nothing was sent: publish the valid ones alone
            for item, token in zip(items, tokens):
                self._publish_or_dead_letter(item, token)

    # A row's dead letter carries its publish token as a once-marker: a relay that died
    # after writing it and before deleting the row leaves the row to the next relay,
    # which then writes no second dead letter.

    def _publish_or_dead_letter(self, item: tuple[str, Envelope], token: str) -> None:
        queue, envelope = item
        try:
            self.publisher.publish_many([item], tokens=[token])
        except InvalidEnvelope as exc:
            logger.error("outbox relay: task %s cannot be published (%s): dead-lettered",
                         envelope.task_id, exc)
            failure = Failure(FailureClass.INVALID_PAYLOAD, str(exc),
                              exception_type=type(exc).__name__, task_id=envelope.task_id,
                              task_type=envelope.task_type)
            write_dead_letter(
                self.publisher.client, self.settings, queue,
                envelope_dead_fields(self.settings, envelope, failure, queue=queue,
                                     consumer=self.name),
                dead_record(self.settings, queue, envelope.task_id, failure), once=token)

    def _dead_letter_malformed(self, row: Any, exc: InvalidEnvelope) -> None:
        logger.error("outbox relay: row %s is not an Envelope (%s): dead-lettered", row.id, exc)
        failure = Failure(FailureClass.MALFORMED_ENTRY, f"outbox row {row.id}: {exc}",
                          exception_type=type(exc).__name__)
        fields = {**failure_fields(failure, queue=row.queue, consumer=self.name),
                  "raw.body": row.envelope}
        write_dead_letter(self.publisher.client, self.settings, row.queue, fields,
                          RecordWrite(), once=publish_token(row.id))

    def _report_lag(self) -> None:
        now = time.monotonic()
        if now < self._next_lag_at:
            return
        self._next_lag_at = now + self.lag_interval_s
        lag = self.lag()
        export_lag(lag)
        logger.info("outbox lag: %d rows waiting, oldest %.1f s", lag.waiting, lag.oldest_age_s)
