"""A worker on ``envelope://`` says what it serves once it is ready.

One log line names the queues it consumes and every task type it runs with
the payload versions it accepts, so whoever publishes to it (in any language)
can check the worker takes what they send, e.g.::

    envelope worker ready: queues celery, orders; task types
    order.close_timeout (payload versions 1, 2), send_email (payload versions 1)

Celery's own tasks (``celery.*``: chord unlocks, canvas helpers) are left out.

The same list goes into the worker's announcement (docs/protocol.md, section 15):
:func:`remember_worker` keeps the worker at ``worker_init`` and the transport asks
:func:`announced_tasks` and :func:`announced_concurrency` whenever a consumer registers.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ext.broker import uses_envelope_broker
from celery_ext.protocol import payload_versions

logger = logging.getLogger(__name__)

# The Celery worker of this process (kept at worker_init), if any.
_worker: Any = None


def served_tasks(app: Any) -> dict[str, list[int]]:
    """The task types of ``app`` but Celery's own, each with the payload versions it accepts."""
    return {name: sorted(payload_versions(task)) for name, task in sorted(app.tasks.items())
            if not name.startswith("celery.")}


def served(app: Any, queues: list[str]) -> str:
    """The line naming ``queues`` and the task types of ``app`` with their payload versions."""
    tasks = ", ".join(f"{name} (payload versions {', '.join(map(str, versions))})"
                      for name, versions in served_tasks(app).items())
    return f"envelope worker ready: queues {', '.join(sorted(queues))}; task types {tasks}"


def remember_worker(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: this process's consumers announce ``sender``'s tasks."""
    global _worker
    _worker = sender


def announced_tasks() -> dict[str, list[int]]:
    """What this process's worker serves (``{}`` outside a worker, or before its app is
    finalized)."""
    app = getattr(_worker, "app", None)
    return served_tasks(app) if app is not None and app.finalized else {}


def announced_concurrency() -> int | None:
    """The pool concurrency of this process's worker, when there is one."""
    concurrency = getattr(_worker, "concurrency", None)
    return concurrency if isinstance(concurrency, int) else None


def announce_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` receiver (``sender`` is the worker's consumer): log what it serves."""
    app = getattr(sender, "app", None)
    if app is None or not uses_envelope_broker(app):
        return
    queues = getattr(getattr(sender, "task_consumer", None), "queues", None) or []
    logger.info("%s", served(app, [queue.name for queue in queues]))
