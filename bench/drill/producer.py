"""The drill's producer: publishes at an even pace, and keeps publishing through faults.

Each task gets its own order id (the idempotency key) and task id, chosen before
``apply_async`` so that a task whose publish raised can still be traced. Publishing
retries for longer than the Redis outage lasts; a task counts as published only when
``apply_async`` returned, and one whose ``apply_async`` raised after every retry is
reported as not published, never as lost.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from bench.drill.app import QUEUE, TASK
from bench.drill.config import DrillConfig


@dataclass(frozen=True)
class Planned:
    """One task the producer will publish."""

    index: int
    order_id: str
    task_id: str
    countdown: float | None
    work_ms: int
    queue: str = QUEUE
    #: A burst task's due time, seconds from the start of publishing (else None).
    eta_s: float | None = None


@dataclass(frozen=True)
class Published:
    """A task whose ``apply_async`` returned (``at``: epoch seconds)."""

    task: Planned
    at: float
    seconds: float  # how long apply_async took, retries included
    #: A burst task's eta (epoch seconds).
    eta: float | None = None

    @property
    def due(self) -> float | None:
        """When a delayed task was due (epoch seconds), None for an immediate one."""
        return self.at + self.task.countdown if self.task.countdown is not None else self.eta

    @property
    def immediate(self) -> bool:
        """Published without a countdown or an eta."""
        return self.due is None


@dataclass(frozen=True)
class NotPublished:
    """A task whose ``apply_async`` raised after every retry."""

    task: Planned
    at: float
    error: str


def queue_names(config: DrillConfig) -> list[str]:
    """The drill's queues: ``drill``, then ``drill-1``... (their slots spread over shards)."""
    return [QUEUE, *(f"{QUEUE}-{number}" for number in range(1, config.queues))]


def plan(config: DrillConfig, rng: random.Random) -> list[Planned]:
    """The tasks of a drill, round robin over its queues; exactly ``config.delayed`` of
    them get a countdown."""
    delayed = set(rng.sample(range(config.tasks), config.delayed))
    low, high = config.countdown_s
    queues = queue_names(config)
    return [Planned(index, f"order-{index:05d}", str(uuid.UUID(int=rng.getrandbits(128))),
                    round(rng.uniform(low, high), 2) if index in delayed else None,
                    rng.randint(*config.work_ms), queues[index % len(queues)])
            for index in range(config.tasks)]


def plan_burst(config: DrillConfig, rng: random.Random) -> list[Planned]:
    """The burst: ``config.burst`` tasks of one queue (the last, whose primary the fault
    strikes), all due at ``config.burst_due_s``."""
    queue = queue_names(config)[-1]
    return [Planned(index, f"burst-{index:05d}", str(uuid.UUID(int=rng.getrandbits(128))),
                    None, rng.randint(*config.burst_work_ms), queue, config.burst_due_s)
            for index in range(config.burst)]


def retry_policy(config: DrillConfig) -> dict[str, Any]:
    """kombu retry policy outlasting the outage: a try every second for down time + 20 s."""
    return {"max_retries": math.ceil(config.redis_down_s) + 20, "interval_start": 0,
            "interval_step": 0.5, "interval_max": 1.0}


class Producer(threading.Thread):
    """Publishes ``tasks`` evenly over ``pace_s`` seconds (default ``publish_s``) from
    ``start_at`` (epoch); with ``pace_s`` 0, as fast as it can."""

    def __init__(self, app: Celery, tasks: list[Planned], config: DrillConfig,
                 start_at: float, pace_s: float | None = None,
                 due_base: float | None = None) -> None:
        """``due_base``: the epoch a burst task's ``eta_s`` counts from (``start_at``)."""
        super().__init__(name="drill-producer", daemon=True)
        self.app = app
        self.tasks = tasks
        self.start_at = start_at
        self.due_base = start_at if due_base is None else due_base
        pace = config.publish_s if pace_s is None else pace_s
        self.step_s = pace / max(len(tasks), 1)
        self.policy = retry_policy(config)
        self.published: list[Published] = []
        self.not_published: list[NotPublished] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        # The before_task_publish receiver that derives idempotency keys looks the task
        # up in the current app, which is per thread.
        self.app.set_current()
        task = self.app.tasks[TASK]
        try:
            for planned in self.tasks:
                if self.stopping.wait(max(self.start_at + planned.index * self.step_s
                                          - time.time(), 0)):
                    return
                started = time.time()
                eta = (None if planned.eta_s is None
                       else datetime.fromtimestamp(self.due_base + planned.eta_s, timezone.utc))
                try:
                    task.apply_async(kwargs={"order_id": planned.order_id,
                                             "work_ms": planned.work_ms},
                                     task_id=planned.task_id, countdown=planned.countdown,
                                     eta=eta, queue=planned.queue,
                                     retry=True, retry_policy=self.policy)
                except Exception as exc:
                    self.not_published.append(NotPublished(planned, time.time(),
                                                           f"{type(exc).__name__}: {exc}"))
                else:
                    self.published.append(Published(planned, started, time.time() - started,
                                                    None if eta is None else eta.timestamp()))
        except BaseException as exc:  # reported by the drill, never lost with the thread
            self.error = exc

    @property
    def attempted(self) -> int:
        """Tasks whose apply_async has returned or raised."""
        return len(self.published) + len(self.not_published)
