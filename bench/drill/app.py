"""The Celery app of the drill (``celery -A bench.drill.app worker``), on either broker.

Workers are configured from the environment:

* ``DRILL_BROKER_URL``: ``envelope://...`` or ``redis://...``.
* ``DRILL_TRANSPORT_OPTIONS``: JSON object of broker transport options.
* ``DRILL_LEDGER_URL``, ``DRILL_RUN``: where and under which run the tasks record
  what they do (:mod:`bench.drill.ledger`).

Settings are those docs/operations.md recommends (``task_acks_late``,
``task_reject_on_worker_lost``); everything else is Celery's default, prefetch
multiplier included. The retry policy and the idempotency defer are shortened so
that a drill ends in minutes. Importing ``celery_ext`` serves both brokers: on
``redis://`` it only derives the ``idempotency_key`` header, which nothing reads.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, Task, signals

import celery_ext  # noqa: F401  (envelope:// and idempotency keys)
from bench.drill.ledger import Ledger
from celery_ext.idempotency import KEY_HEADER

#: The queue of the drill's tasks, and their name.
QUEUE = "drill"
TASK = "drill.effect"

_ledger: tuple[int, Ledger] | None = None


def ledger() -> Ledger:
    """This process's ledger (a forked pool process opens its own connection)."""
    global _ledger
    if _ledger is None or _ledger[0] != os.getpid():
        _ledger = (os.getpid(), Ledger.from_env())
    return _ledger[1]


def create_app(broker_url: str, transport_options: dict[str, Any]) -> Celery:
    """The drill's app on ``broker_url``."""
    app = Celery("drill", broker=broker_url)
    app.conf.update(
        task_default_queue=QUEUE,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        result_backend=None,
        envelope_retry_policy={"fast_retries": 2, "backoff_s": 1.0, "max_backoff_s": 4.0},
        envelope_idempotency_defer=1.0,
    )

    @app.task(name=TASK, bind=True, shared=False, idempotency_fields=("order_id",))
    def effect(self: Task, order_id: str, work_ms: int) -> None:
        """Note the run, work ``work_ms``, then record the effect of ``order_id``."""
        request = self.request
        key = (request.headers or {}).get(KEY_HEADER) or getattr(request, KEY_HEADER, None)
        ledger().add("runs", task=request.id, order=order_id, host=request.hostname, key=key)
        time.sleep(work_ms / 1000)
        ledger().add_effect(task=request.id, order=order_id, host=request.hostname)

    return app


def _is_drill_task(task: Any) -> bool:
    return getattr(task, "name", None) == TASK


@signals.task_prerun.connect(weak=False)
def _started(sender: Any = None, task_id: str | None = None, kwargs: Any = None,
             **_: Any) -> None:
    if _is_drill_task(sender):
        info = sender.request.delivery_info or {}
        ledger().add("deliveries", task=task_id, order=(kwargs or {}).get("order_id"),
                     host=sender.request.hostname, redelivered=info.get("redelivered"))


@signals.task_success.connect(weak=False)
def _succeeded(sender: Any = None, **_: Any) -> None:
    if _is_drill_task(sender):
        ledger().add("outcomes", task=sender.request.id, state="success",
                     host=sender.request.hostname)


@signals.task_failure.connect(weak=False)
def _failed(sender: Any = None, task_id: str | None = None, exception: Any = None,
            **_: Any) -> None:
    if _is_drill_task(sender):
        ledger().add("outcomes", task=task_id, state="failure", host=sender.request.hostname,
                     error=f"{type(exception).__name__}: {exception}")


@signals.task_retry.connect(weak=False)
def _retried(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
    if _is_drill_task(sender):
        ledger().add("outcomes", task=getattr(request, "id", None), state="retry",
                     host=getattr(request, "hostname", None), error=str(reason))


@signals.worker_ready.connect(weak=False)
def _ready(sender: Any = None, **_: Any) -> None:
    if "DRILL_LEDGER_URL" in os.environ:
        ledger().add("ready", host=getattr(sender, "hostname", None))


app = create_app(os.environ.get("DRILL_BROKER_URL", "memory://"),
                 json.loads(os.environ.get("DRILL_TRANSPORT_OPTIONS") or "{}"))
