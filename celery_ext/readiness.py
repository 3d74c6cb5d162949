"""A worker on ``envelope://`` says what it serves once it is ready.

One log line names the queues it consumes and every task type it runs with
the payload versions it accepts, so whoever publishes to it (in any language)
can check the worker takes what they send, e.g.::

    envelope worker ready: queues celery, orders; task types
    order.close_timeout (payload versions 1, 2), send_email (payload versions 1)

Celery's own tasks (``celery.*``: chord unlocks, canvas helpers) are left out.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ext.bootsteps import uses_envelope_broker
from celery_ext.protocol import payload_versions

logger = logging.getLogger(__name__)


def served(app: Any, queues: list[str]) -> str:
    """The line naming ``queues`` and the task types of ``app`` with their payload versions."""
    tasks = ", ".join(
        f"{name} (payload versions {', '.join(map(str, sorted(payload_versions(task))))})"
        for name, task in sorted(app.tasks.items()) if not name.startswith("celery."))
    return f"envelope worker ready: queues {', '.join(sorted(queues))}; task types {tasks}"


def announce_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` receiver (``sender`` is the worker's consumer): log what it serves."""
    app = getattr(sender, "app", None)
    if app is None or not uses_envelope_broker(app):
        return
    queues = getattr(getattr(sender, "task_consumer", None), "queues", None) or []
    logger.info("%s", served(app, [queue.name for queue in queues]))
