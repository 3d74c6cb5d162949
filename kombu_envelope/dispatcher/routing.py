"""Which queue a posted task goes to: one whose live or recently seen workers serve its
type and version (docs/protocol.md, section 15), else a 409 naming what is served.

A positive answer is kept :data:`SERVED_CACHE_S` (workers are "recently seen" for an
hour, so a second changes nothing); a refusal is never kept, so a worker that has just
started is seen at once.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from kombu_envelope.dispatcher.problems import Problem

#: How long a positive answer is kept (seconds).
SERVED_CACHE_S = 1.0


class Router:
    """Answers "where does this task go" from the worker announcements."""

    def __init__(self, announcements: Any) -> None:
        self.announcements = announcements
        self._served: dict[tuple[str | None, str, int], tuple[float, str]] = {}
        self._lock = threading.Lock()

    def queue_for(self, queue: str | None, task_type: str, version: int) -> str:
        """``queue`` when its workers serve the task; without ``queue``, the first queue
        whose workers do. Raises a 409 :class:`Problem` otherwise."""
        key = (queue, task_type, version)
        now = time.monotonic()
        with self._lock:
            cached = self._served.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = self._look_up(queue, task_type, version)
        with self._lock:
            self._served[key] = (now + SERVED_CACHE_S, found)
        return found

    def _look_up(self, queue: str | None, task_type: str, version: int) -> str:
        if queue is not None:
            if self.announcements.served(queue, task_type, version):
                return queue
            served = self.announcements.serves_on(queue)
            raise Problem(409, "not_served", (
                f"no live or recently seen worker on queue {queue!r} serves {task_type} "
                f"version {version}; its workers serve {json.dumps(served, sort_keys=True)}"),
                queue=queue, task_type=task_type, payload_version=version, served=served)
        queues = self.announcements.serving_queues(task_type, version)
        if not queues:
            raise Problem(409, "not_served", (
                f"no live or recently seen worker on any queue serves {task_type} version "
                f"{version}"), task_type=task_type, payload_version=version, served={})
        routed: str = queues[0]
        return routed
