"""Outcome of every test of one pytest run, read from its JUnit XML report.

Test ids look like pytest's node ids with the file's directory left out:
``test_tasks.py::test_tasks::test_fail``. A test reported more than once (a teardown
error after a pass, subtests) gets its worst outcome.
"""

from __future__ import annotations

import enum
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CaseResult", "Outcome", "read_junit"]


class Outcome(str, enum.Enum):
    """What pytest said of one test, best first."""

    PASSED = "passed"
    SKIPPED = "skipped"
    XFAILED = "xfailed"
    FAILED = "failed"
    ERROR = "error"

    @property
    def failing(self) -> bool:
        """A failure or an error (in setup, call or teardown)."""
        return self in (Outcome.FAILED, Outcome.ERROR)


_RANK = {outcome: rank for rank, outcome in enumerate(Outcome)}


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome, duration (setup to teardown) and first line of its error."""

    test_id: str
    outcome: Outcome
    seconds: float
    message: str = ""
    #: Which attempt gave this outcome (1 unless the harness ran the test again).
    attempt: int = 1


def _test_id(classname: str, name: str, modules: Iterable[str]) -> str:
    """``t.integration.test_tasks.test_tasks`` + ``test_fail`` -> ``test_tasks.py::...``."""
    for module in sorted(modules, key=len, reverse=True):
        if classname == module or classname.startswith(module + "."):
            inner = classname[len(module) + 1:]
            parts = [module.rsplit(".", 1)[-1] + ".py", *filter(None, inner.split(".")), name]
            return "::".join(parts)
    return f"{classname}::{name}"


def _outcome(case: ET.Element) -> tuple[Outcome, str]:
    worst, message = Outcome.PASSED, ""
    for child in case:
        if child.tag == "failure":
            found = Outcome.FAILED
        elif child.tag == "error":
            found = Outcome.ERROR
        elif child.tag == "skipped":
            found = Outcome.XFAILED if child.get("type") == "pytest.xfail" else Outcome.SKIPPED
        else:
            continue
        if _RANK[found] > _RANK[worst]:
            worst = found
            lines = (child.get("message") or "").strip().splitlines()
            message = lines[0] if lines else ""
    return worst, message


def read_junit(path: Path, modules: Iterable[str]) -> dict[str, CaseResult]:
    """Every test of the report at ``path``, by test id.

    :param modules: dotted names of the test modules that ran (``t.integration.test_tasks``),
        to turn JUnit class names back into file names.
    """
    modules = list(modules)
    results: dict[str, CaseResult] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # written for the test running when pytest was interrupted
        test_id = _test_id(case.get("classname", ""), case.get("name", ""), modules)
        outcome, message = _outcome(case)
        seconds = float(case.get("time") or 0.0)
        seen = results.get(test_id)
        if seen is not None:
            seconds += seen.seconds
            if _RANK[seen.outcome] >= _RANK[outcome]:
                outcome, message = seen.outcome, seen.message
        results[test_id] = CaseResult(test_id, outcome, seconds, message)
    return results
