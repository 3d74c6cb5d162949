"""``python -m kombu_envelope.outbox``: relay committed outbox rows to the streams::

    python -m kombu_envelope.outbox --db postgresql+psycopg://app@db/app \
        --url redis://localhost:6379/0

Any number may run against one PostgreSQL outbox; on SQLite they take turns. The
database URL may also come from ``ENVELOPE_OUTBOX_DB`` (keeping its password off
the command line). Stops on SIGINT or SIGTERM after the batch in progress.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Sequence

from kombu_envelope.outbox.options import (
    DB_URL_ENV,
    DEFAULT_BATCH,
    DEFAULT_IDLE_S,
    DEFAULT_LAG_INTERVAL_S,
)
from kombu_envelope.outbox.relay import Relay, outbox_engine
from kombu_envelope.scheduler import standalone_settings
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import client_for_url
from kombu_envelope.store.publisher import Publisher

logger = logging.getLogger(__name__)


def stop_on_signals() -> threading.Event:
    """An event set on SIGINT or SIGTERM (handlers installed now)."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m kombu_envelope.outbox``."""
    parser = argparse.ArgumentParser(description="Relay committed outbox rows to the streams.")
    parser.add_argument("--db", default=os.environ.get(DB_URL_ENV),
                        help=f"SQLAlchemy database URL (default: ${DB_URL_ENV})")
    parser.add_argument("--url", default="redis://localhost:6379/0",
                        help="Redis URL: redis://, rediss://, or any envelope URL")
    parser.add_argument("--master-name", default=None,
                        help="the Sentinel group's primary, with an envelope-sentinel:// URL")
    parser.add_argument("--key-prefix", default=Settings.key_prefix, help="key prefix")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per transaction")
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_S,
                        help="seconds between two looks at an empty outbox")
    parser.add_argument("--lag-interval", type=float, default=DEFAULT_LAG_INTERVAL_S,
                        help="seconds between two lag reports")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the lag gauges on this port (needs prometheus_client)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.db:
        parser.error(f"--db (or ${DB_URL_ENV}) is required")
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    settings = standalone_settings(args.key_prefix, args.master_name)
    relay = Relay(outbox_engine(args.db), Publisher(client_for_url(args.url, settings), settings),
                  batch=args.batch, idle_s=args.idle, lag_interval_s=args.lag_interval)
    stop = stop_on_signals()
    logger.info("relaying the outbox to %s (prefix %s)", args.url, args.key_prefix)
    relay.run(stop)


if __name__ == "__main__":
    main()
