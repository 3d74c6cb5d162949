"""What the drill's tasks record, in a Redis the drill never kills.

Every record is a JSON object appended to a list under ``drill:<run>:``:

* ``deliveries``: each time a worker starts a task (Celery's ``task_prerun``), with the
  task id, order id, pid and worker; a task started more than once was redelivered.
* ``runs``: each time the task body begins (after the idempotency claim let it run),
  with the ``idempotency_key`` header the worker saw.
* ``effects``: each time the body reaches its effect (the business action); the
  hash ``effect-count`` counts them per order id in the same transaction.
* ``outcomes``: how Celery ended each start (``success``, ``failure``, ``retry``).
* ``ready``: each worker that finished starting, with its main pid.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import redis

#: Record kinds, each a Redis list.
KINDS = ("deliveries", "runs", "effects", "outcomes", "ready")

Record = dict[str, Any]


class Ledger:
    """Records of one drill run (``run``) on the ledger Redis."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.run = run

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Ledger:
        """The ledger named by ``DRILL_LEDGER_URL`` and ``DRILL_RUN``."""
        return cls(redis.Redis.from_url(environ["DRILL_LEDGER_URL"]), environ["DRILL_RUN"])

    def key(self, name: str) -> str:
        """Key ``name`` of this run."""
        return f"drill:{self.run}:{name}"

    def add(self, kind: str, **fields: Any) -> None:
        """Append a record of ``kind`` (with this process's pid and the time)."""
        record = {"pid": os.getpid(), "t": time.time(), **fields}
        self.client.rpush(self.key(kind), json.dumps(record))

    def add_effect(self, **fields: Any) -> int:
        """Record an effect of ``fields["order"]``; return how many that order has had."""
        record = {"pid": os.getpid(), "t": time.time(), **fields}
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.key("effect-count"), fields["order"], 1)
        pipe.rpush(self.key("effects"), json.dumps(record))
        count, _ = pipe.execute()
        return int(count)

    def records(self, kind: str) -> list[Record]:
        """Every record of ``kind``, oldest first."""
        return [json.loads(raw) for raw in self.client.lrange(self.key(kind), 0, -1)]

    def count(self, kind: str) -> int:
        """How many records of ``kind`` exist."""
        return int(self.client.llen(self.key(kind)))

    def orders_with_effect(self) -> int:
        """How many order ids have had at least one effect."""
        return int(self.client.hlen(self.key("effect-count")))

    def ready_hosts(self) -> set[str]:
        """Hostnames of the workers that reported ready."""
        return {record["host"] for record in self.records("ready")}
