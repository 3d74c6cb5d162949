"""The tasks of the limits tests, ``limits.task`` and ``limits.fast`` (:mod:`apps.limits_app`),
and of the ordering keys, ``ordering.step``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis
from celery import Celery, Task


def add_limits_tasks(app: Celery, records: Callable[[], redis.Redis], prefix: str) -> None:
    """Register ``limits.task``, ``limits.fast`` and ``limits.flaky`` on ``app``."""

    def run(task: Task, sleep_ms: int) -> None:
        start_ms = time.time() * 1000
        time.sleep(sleep_ms / 1000)
        records().rpush(f"{prefix}:mx:spans", json.dumps({
            "language": "py", "task_id": task.request.id, "start_ms": start_ms,
            "end_ms": time.time() * 1000}))

    @app.task(name="limits.task", shared=False, bind=True)
    def limits_task(self: Task, sleep_ms: int = 0) -> None:
        run(self, sleep_ms)

    @app.task(name="limits.fast", shared=False, bind=True)
    def limits_fast(self: Task, sleep_ms: int = 0) -> None:
        run(self, sleep_ms)

    @app.task(name="ordering.step", shared=False, bind=True)
    def ordering_step(self: Task, log: str, sleep_ms: int = 0, fail_once: bool = False,
                      fail: bool = False) -> None:
        """Records ``start <id>`` and ``end <id>`` in ``<prefix>:mx:log:<log>``; with
        ``fail_once`` its first attempt fails and is retried 0.1 s later, with ``fail``
        every attempt fails (and it is dead-lettered)."""
        entries = f"{prefix}:mx:log:{log}"
        records().rpush(entries, f"start {self.request.id}")
        time.sleep(sleep_ms / 1000)
        if fail:
            raise RuntimeError("ordering.step asked to fail")
        if fail_once and records().set(f"{prefix}:mx:failed:{self.request.id}", 1, nx=True):
            raise self.retry(countdown=0.1)
        records().rpush(entries, f"end {self.request.id}")

    @app.task(name="limits.flaky", shared=False, bind=True)
    def limits_flaky(self: Task, sleep_ms: int = 0) -> None:
        """Fails while ``<prefix>:mx:fail`` exists (a sick downstream), else as limits.task."""
        if records().exists(f"{prefix}:mx:fail"):
            raise RuntimeError("the downstream is failing")
        run(self, sleep_ms)
