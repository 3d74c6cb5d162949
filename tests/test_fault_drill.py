"""The fault drill on ``envelope://``: real prefork workers SIGKILLed every few seconds
and the broker's redis-server SIGKILLed and restarted from its AOF while 200 tasks (a
fifth of them delayed) are published; no task may be lost and no effect may happen twice.

The drill itself lives in ``bench/drill`` (``python -m bench drill`` runs the large one,
and the same drill on Celery's stock ``redis://``); on failure the message lists the
lost and duplicated orders with every record of them, the dead letters, the worker log
lines and the timeline of the faults.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.drill.config import ENVELOPE, SMALL
from bench.drill.run import run_drill


@pytest.mark.slow
@pytest.mark.timeout(300)  # the drill's own deadlines end it first, with diagnostics
def test_fault_drill_loses_no_task_and_runs_no_effect_twice(tmp_path: Path) -> None:
    report = run_drill(SMALL.replace(broker=ENVELOPE), tmp_path)
    if not report.passed:
        pytest.fail(report.diagnostics(), pytrace=False)
