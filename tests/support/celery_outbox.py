"""A Celery app on ``envelope://`` with ``envelope_outbox`` set, for the outbox tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

import celery_ext  # noqa: F401  (the envelope:// transport for Celery)
from tests.support.envelope_streams import envelope_url

#: The queue the app's tasks go to.
QUEUE = "outbox"


@contextmanager
def outbox_app(redis_url: str, key_prefix: str, mode: str) -> Iterator[tuple[Celery, Any]]:
    """The app (current while inside) and its task ``order.placed``."""
    app = Celery("outbox", broker=envelope_url(redis_url), set_as_current=True)
    app.conf.update(broker_transport_options={"key_prefix": key_prefix},
                    task_default_queue=QUEUE, envelope_outbox=mode)

    @app.task(name="order.placed", shared=False)
    def placed(n: int) -> int:
        return n

    try:
        yield app, placed
    finally:
        app.close()
