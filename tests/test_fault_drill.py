"""The fault drill on ``envelope://``: real prefork workers SIGKILLed every few seconds
and the broker's redis-server SIGKILLed and restarted from its AOF while 200 tasks (a
fifth of them delayed) are published; no task may be lost and no effect may happen twice.

The drill itself lives in ``bench/drill`` (``python -m bench drill`` runs the large one,
and the same drill on Celery's stock ``redis://``); on failure the message lists the
lost and duplicated orders with every record of them, the dead letters, the worker log
lines and the timeline of the faults.

The Cluster drill runs Celery, Go, Node.js and Java workers (the interop peers' ``drill``
handlers), one of each, SIGKILLed in turn, through a primary's SIGKILL, a ``CLUSTER
FAILOVER`` while a burst of delayed tasks larger than a promoter batch is being promoted,
a resharding and a primary's SIGSTOP longer than the lease.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.drill.config import ENVELOPE, LANGUAGES, SMALL, SMALL_CLUSTER
from bench.drill.run import run_drill


@pytest.mark.slow
@pytest.mark.timeout(300)  # the drill's own deadlines end it first, with diagnostics
def test_fault_drill_loses_no_task_and_runs_no_effect_twice(tmp_path: Path) -> None:
    report = run_drill(SMALL.replace(broker=ENVELOPE), tmp_path)
    if not report.passed:
        pytest.fail(report.diagnostics(), pytrace=False)


@pytest.mark.slow
@pytest.mark.timeout(300)  # peer builds included; the drill's own deadlines end it first
def test_cluster_drill_with_every_language_loses_only_the_no_wait_window(
        tmp_path: Path) -> None:
    report = run_drill(SMALL_CLUSTER.replace(languages=LANGUAGES), tmp_path)
    if not report.passed:
        pytest.fail(report.diagnostics(), pytrace=False)
    assert set(report.fault_spans) == {"primary-kill", "failover", "reshard", "primary-stall"}
    assert set(report.languages.values()) == set(LANGUAGES)  # every one started and was ready
    assert not report.duplicated_outside_window()
