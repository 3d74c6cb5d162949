"""A Celery app that imports ``kombu_envelope`` where it should import ``celery_ext``.

Configured from the environment like the other apps: ``TEST_BROKER_URL``,
``TEST_RESULT_BACKEND``, ``TEST_KEY_PREFIX``, and ``TEST_TRANSPORT_OPTIONS`` (JSON of
more broker transport options). Loaded by ``celery -A apps.kombu_only_app worker``, it
still gets ``celery_ext`` from the command line's plugin entry point.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

import kombu_envelope  # noqa: F401  (the mistake under test: not celery_ext)


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None,
               transport_options: dict[str, Any] | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    result_backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or None
    key_prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    if transport_options is None:
        transport_options = json.loads(os.environ.get("TEST_TRANSPORT_OPTIONS") or "{}")

    app = Celery("kombu_only_app", broker=broker_url, backend=result_backend)
    app.conf.update(
        broker_transport_options={"key_prefix": key_prefix, **transport_options},
        result_backend_transport_options={"global_keyprefix": f"{key_prefix}:"},
        broker_connection_retry_on_startup=True,
    )

    @app.task(name="kombu_only_app.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


app = create_app()
