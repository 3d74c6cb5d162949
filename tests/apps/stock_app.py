"""Celery app on the stock ``redis://`` transport, used to validate the worker harness.

Configured from the environment when loaded by a worker:

* ``TEST_BROKER_URL`` - broker URL (required by workers).
* ``TEST_RESULT_BACKEND`` - result backend URL (defaults to the broker URL).
* ``TEST_KEY_PREFIX`` - Redis key prefix isolating one test's keys.
* ``TEST_QUEUE`` - default queue name.
"""

from __future__ import annotations

import os
import time

from celery import Celery


def create_app(
    broker_url: str | None = None,
    result_backend: str | None = None,
    key_prefix: str | None = None,
    queue: str | None = None,
) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    result_backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or broker_url
    key_prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "")
    queue = queue or os.environ.get("TEST_QUEUE", "celery")

    app = Celery("stock_app", broker=broker_url, backend=result_backend)
    transport_options = {"global_keyprefix": f"{key_prefix}:"} if key_prefix else {}
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options=transport_options,
        result_backend_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        result_expires=600,
    )

    @app.task(name="stock_app.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="stock_app.sleep", shared=False)
    def sleep(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    return app


app = create_app()
