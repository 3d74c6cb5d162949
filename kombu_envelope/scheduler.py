"""``python -m kombu_envelope.scheduler``: a standalone promoter of delayed tasks.

For deployments without Python workers (every Python worker runs one)::

    python -m kombu_envelope.scheduler --url redis://localhost:6379/0

Behind Sentinel, the sentinels' own password is read from the environment variable
``ENVELOPE_SENTINEL_PASSWORD`` (never from the command line, which others can see)::

    python -m kombu_envelope.scheduler --master-name mymaster \
        --url "envelope-sentinel://:pw@s1:26379;envelope-sentinel://s2:26379"
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Sequence

from kombu_envelope.settings import Settings
from kombu_envelope.store.client import client_for_url
from kombu_envelope.store.promoter import DEFAULT_BATCH, Promoter

logger = logging.getLogger(__name__)

#: Environment variable holding the sentinels' password (``requirepass`` of the sentinels).
SENTINEL_PASSWORD_ENV = "ENVELOPE_SENTINEL_PASSWORD"


def standalone_settings(key_prefix: str, master_name: str | None) -> Settings:
    """Settings of a tool run without Celery; the sentinels' password from the environment."""
    sentinel_password = os.environ.get(SENTINEL_PASSWORD_ENV)
    return Settings(key_prefix=key_prefix, master_name=master_name,
                    sentinel_kwargs={"password": sentinel_password} if sentinel_password
                    else None)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m kombu_envelope.scheduler``."""
    parser = argparse.ArgumentParser(description="Promote due delayed tasks to their streams.")
    parser.add_argument("--url", default="redis://localhost:6379/0",
                        help="Redis URL: redis://, rediss://, or any envelope URL "
                             "(envelope-sentinel://...;..., envelope-cluster://...;...)")
    parser.add_argument("--master-name", default=None,
                        help="the Sentinel group's primary, with an envelope-sentinel:// URL")
    parser.add_argument("--key-prefix", default=Settings.key_prefix, help="key prefix")
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="tasks per step")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    settings = standalone_settings(args.key_prefix, args.master_name)
    client = client_for_url(args.url, settings)
    promoter = Promoter(lambda: client, settings, batch=args.batch)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logger.info("promoting delayed tasks of %s (prefix %s)", args.url, args.key_prefix)
    promoter.start()
    stop.wait()
    promoter.stop()


if __name__ == "__main__":
    main()
