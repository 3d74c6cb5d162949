"""Both brokers' outcomes side by side, and what must hold between them.

The stock broker (``redis://``) is the reference: ``envelope://`` must pass at least as
many tests, and each test failing on ``envelope://`` only must be explained in the docs.
A test missing from a run (it did not finish) counts as failing there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.celery_suite.junit import CaseResult, Outcome
from bench.celery_suite.run import BrokerRun

__all__ = ["Comparison", "Row"]


def _failing(result: CaseResult | None) -> bool:
    return result is None or result.outcome.failing


def _cell(result: CaseResult | None) -> str:
    if result is None:
        return "missing"
    word = result.outcome.value
    if result.attempt > 1:
        word += f" ({result.attempt})"  # on that attempt (bench.celery_suite.rerun)
    return word.upper() if result.outcome.failing else word


@dataclass(frozen=True)
class Row:
    """One test on both brokers."""

    test_id: str
    stock: CaseResult | None
    envelope: CaseResult | None

    @property
    def envelope_only_failure(self) -> bool:
        """Fails on ``envelope://``, not on ``redis://``."""
        return _failing(self.envelope) and not _failing(self.stock)

    @property
    def stock_only_failure(self) -> bool:
        """Fails on ``redis://``, not on ``envelope://``."""
        return _failing(self.stock) and not _failing(self.envelope)


@dataclass
class Comparison:
    """The stock run, the envelope run and the documented explanations."""

    stock: BrokerRun
    envelope: BrokerRun
    explained: dict[str, str]

    def rows(self) -> list[Row]:
        """Every test of either run, in the stock run's order."""
        ids = list(self.stock.results)
        ids += [i for i in self.envelope.results if i not in self.stock.results]
        return [Row(i, self.stock.results.get(i), self.envelope.results.get(i)) for i in ids]

    def envelope_only(self) -> list[Row]:
        """Tests failing on ``envelope://`` only."""
        return [row for row in self.rows() if row.envelope_only_failure]

    def stock_only(self) -> list[Row]:
        """Tests failing on ``redis://`` only."""
        return [row for row in self.rows() if row.stock_only_failure]

    def unexplained(self) -> list[str]:
        """Envelope-only failures the docs do not explain."""
        return [row.test_id for row in self.envelope_only() if row.test_id not in self.explained]

    def problems(self) -> list[str]:
        """Why the comparison fails (empty when it holds)."""
        found = [f"{run.broker.label}: {run.error}" for run in (self.stock, self.envelope)
                 if run.error]
        if self.envelope.passed < self.stock.passed:
            found.append(f"envelope:// passed {self.envelope.passed} tests, "
                         f"redis:// {self.stock.passed}")
        found += [f"{test} fails on envelope:// only and docs/celery-compatibility.md "
                  "does not explain it" for test in self.unexplained()]
        return found

    def table(self, *, all_rows: bool = True) -> str:
        """Plain-text side-by-side table (only differing rows unless ``all_rows``)."""
        rows = self.rows()
        shown = [r for r in rows if all_rows or r.envelope_only_failure or r.stock_only_failure]
        width = max([len(r.test_id) for r in shown] + [len("seconds")])
        header = f"{'test':<{width}}  {'redis://':>10}  {'envelope://':>11}  note"
        lines = [header, "-" * len(header)]
        for row in shown:
            note = ""
            if row.envelope_only_failure:
                note = "explained" if row.test_id in self.explained else "NOT EXPLAINED"
            elif row.stock_only_failure:
                note = "stock only"
            lines.append(f"{row.test_id:<{width}}  {_cell(row.stock):>10}  "
                         f"{_cell(row.envelope):>11}  {note}")
        lines.append("-" * len(header))
        for outcome in Outcome:
            lines.append(f"{outcome.value:<{width}}  {self.stock.counts()[outcome]:>10}  "
                         f"{self.envelope.counts()[outcome]:>11}")
        lines.append(f"{'seconds':<{width}}  {self.stock.seconds:>10.0f}  "
                     f"{self.envelope.seconds:>11.0f}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary: counts, timings, every outcome, and the differences."""
        def run_dict(run: BrokerRun) -> dict[str, Any]:
            return {
                "broker": run.broker.label,
                "seconds": round(run.seconds, 1),
                "error": run.error,
                "counts": {o.value: run.counts()[o] for o in Outcome},
                "results": {r.test_id: {"outcome": r.outcome.value,
                                        "attempt": r.attempt,
                                        "seconds": round(r.seconds, 2),
                                        "message": r.message}
                            for r in run.results.values()},
            }
        return {
            "files": list(self.stock.files),
            "runs": {"redis": run_dict(self.stock), "envelope": run_dict(self.envelope)},
            "envelope_only": [row.test_id for row in self.envelope_only()],
            "stock_only": [row.test_id for row in self.stock_only()],
            "unexplained": self.unexplained(),
            "problems": self.problems(),
        }
