"""The outbox's lag: rows waiting and the age of the oldest, as Prometheus gauges.

The gauges (``envelope_outbox_rows_waiting``, ``envelope_outbox_oldest_row_age_seconds``)
exist when ``prometheus_client`` is installed (the ``metrics`` extra); the relay
also logs the lag. Expose them as usual (``prometheus_client.start_http_server``;
``python -m kombu_envelope.outbox --metrics-port``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, func, select

from kombu_envelope.envelope import utcnow
from kombu_envelope.outbox.table import outbox_table


@dataclass(frozen=True)
class OutboxLag:
    """How far the relay is behind."""

    #: Rows not relayed yet.
    waiting: int
    #: Seconds since the oldest of them was written (0 when none waits).
    oldest_age_s: float


def measure_lag(conn: Connection, now: datetime | None = None) -> OutboxLag:
    """Count the waiting rows and age the oldest, in one query."""
    count, oldest = conn.execute(
        select(func.count(), func.min(outbox_table.c.created_at))).one()
    if oldest is None:
        return OutboxLag(waiting=count, oldest_age_s=0.0)
    if oldest.tzinfo is None:  # SQLite keeps no offset: rows are written in UTC
        oldest = oldest.replace(tzinfo=timezone.utc)
    age = ((now or utcnow()) - oldest).total_seconds()
    return OutboxLag(waiting=count, oldest_age_s=max(age, 0.0))


def _gauges() -> tuple[Any, Any] | None:
    try:
        from prometheus_client import Gauge
    except ImportError:  # pragma: no cover - the metrics extra is optional
        return None
    return (Gauge("envelope_outbox_rows_waiting", "Outbox rows not relayed yet"),
            Gauge("envelope_outbox_oldest_row_age_seconds",
                  "Age of the oldest outbox row not relayed yet"))


_GAUGES = _gauges()


def export_lag(lag: OutboxLag) -> None:
    """Set the gauges to ``lag`` (nothing without prometheus_client)."""
    if _GAUGES is None:
        return
    waiting, age = _GAUGES
    waiting.set(lag.waiting)
    age.set(lag.oldest_age_s)
