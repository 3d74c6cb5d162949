"""A relay that stops between publishing a batch and deleting its rows (for SIGKILL tests).

``python tests/support/outbox_relay_crash.py DB_URL REDIS_URL KEY_PREFIX MARKER``: relays
one batch; after publishing it creates ``MARKER`` and sleeps until killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from kombu_envelope.outbox.relay import Relay, outbox_engine
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import client_for_url
from kombu_envelope.store.publisher import Publisher


class PausingPublisher(Publisher):
    """Publishes, then marks the moment and waits to be killed."""

    marker: Path

    def publish_many(self, *args: Any, **kwargs: Any) -> list[str | None]:
        replies = super().publish_many(*args, **kwargs)
        self.marker.write_text(str(len(replies)))
        time.sleep(60)
        return replies


def main() -> None:
    db_url, redis_url, key_prefix, marker = sys.argv[1:]
    settings = Settings(key_prefix=key_prefix)
    publisher = PausingPublisher(client_for_url(redis_url, settings), settings)
    publisher.marker = Path(marker)
    Relay(outbox_engine(db_url), publisher, batch=1000).relay_batch()


if __name__ == "__main__":
    main()
