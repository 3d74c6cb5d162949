"""Prometheus counters of task outcomes, when ``prometheus_client`` is installed.

Install the ``metrics`` extra and expose them as usual (for example with
``prometheus_client.start_http_server`` in a ``worker_init`` receiver). With
the prefork pool each child counts on its own: set ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode) to aggregate them. Without
``prometheus_client`` every function here does nothing.
"""

from __future__ import annotations

from typing import Any

_OUTCOMES = ("succeeded", "failed", "retried", "dead_lettered", "duplicates")


def _counters() -> dict[str, Any]:
    try:
        from prometheus_client import Counter
    except ImportError:  # pragma: no cover - the metrics extra is optional
        return {}
    counters = {
        outcome: Counter(f"envelope_tasks_{outcome}", f"Tasks {outcome.replace('_', ' ')}",
                         ["task_type"])
        for outcome in _OUTCOMES if outcome != "dead_lettered"
    }
    counters["dead_lettered"] = Counter("envelope_tasks_dead_lettered",
                                        "Tasks dead-lettered", ["task_type", "failure_class"])
    return counters


COUNTERS = _counters()


def count(outcome: str, task_type: str, failure_class: str | None = None) -> None:
    """Add one to the counter of ``outcome`` (one of succeeded, failed, retried,
    dead_lettered, duplicates) for ``task_type``."""
    counter = COUNTERS.get(outcome)
    if counter is None:
        return
    labels = (task_type, failure_class or "") if outcome == "dead_lettered" else (task_type,)
    counter.labels(*labels).inc()
