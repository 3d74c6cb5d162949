"""The relay's tunables and their defaults (importable without SQLAlchemy)."""

from __future__ import annotations

#: Rows relayed per transaction by default.
DEFAULT_BATCH = 100
#: Seconds between two looks at an empty outbox.
DEFAULT_IDLE_S = 0.2
#: Seconds between two lag reports (gauges and log line).
DEFAULT_LAG_INTERVAL_S = 10.0
#: Longest wait before trying again after a database or Redis error (seconds).
MAX_BACKOFF_S = 5.0
#: Environment variable holding the outbox's database URL when none is given.
DB_URL_ENV = "ENVELOPE_OUTBOX_DB"
