"""Celery app of the Redis Cluster tests: tasks record their effects in a ledger Redis.

Configured from the environment when loaded by a worker:

* ``TEST_BROKER_URL``: the ``envelope-cluster://...;...`` URL.
* ``TEST_KEY_PREFIX``, ``TEST_LEASE_MS``: the transport's ``key_prefix`` and ``lease_ms``.
* ``TEST_LEDGER_URL``: a Redis outside the Cluster (never failed over) where
  :func:`record` counts each order's effects, per queue.

Everything else is Celery's default.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_ext  # noqa: F401  (envelope-cluster:// URLs, idempotency keys)

#: Hash of the ledger: order id -> effects.
EFFECTS = "cluster-test:effects"
#: List of the ledger: ``<order id> <start time>`` of every run.
STARTS = "cluster-test:starts"


def create_app(broker_url: str | None = None, key_prefix: str | None = None,
               lease_ms: int | None = None) -> Celery:
    """The app; unset arguments come from the ``TEST_*`` environment variables."""
    app = Celery("cluster_app", broker=broker_url or os.environ.get("TEST_BROKER_URL",
                                                                      "memory://"))
    app.conf.update(
        broker_transport_options={
            "key_prefix": key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope"),
            "lease_ms": lease_ms or int(os.environ.get("TEST_LEASE_MS", "30000"))},
        broker_connection_retry_on_startup=True,
    )
    ledger: list[redis.Redis] = []

    def ledger_client() -> redis.Redis:
        if not ledger:
            ledger.append(redis.Redis.from_url(os.environ["TEST_LEDGER_URL"]))
        return ledger[0]

    @app.task(name="cluster.record", shared=False, idempotency_fields=("order_id",))
    def record(order_id: str) -> None:
        """The business effect of ``order_id``: counted once per run that reaches it."""
        client = ledger_client()
        client.rpush(STARTS, f"{order_id} {time.time()}")
        client.hincrby(EFFECTS, order_id, 1)

    @app.task(name="cluster.fail", shared=False)
    def fail(order_id: str) -> None:
        """Always fails: dead-lettered at its first failure (no retry policy)."""
        raise ValueError(f"order {order_id} cannot be served")

    return app


app = create_app()
