"""Summaries of repeated measurements: median, spread, percentiles and paired ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100) of ``values``, linearly interpolated."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of ``samples``."""
    if not samples:
        return {"median": math.nan, "min": math.nan, "max": math.nan,
                "q1": math.nan, "q3": math.nan}
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "q1": percentile(samples, 25),
        "q3": percentile(samples, 75),
    }


@dataclass
class Measure:
    """One figure of one transport, measured once per repetition."""

    label: str
    transport: str
    unit: str
    higher_is_better: bool = True
    samples: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        """Record the value of one repetition."""
        self.samples.append(float(value))

    @property
    def median(self) -> float:
        """Median over the repetitions."""
        return summarize(self.samples)["median"]

    def to_json(self) -> dict[str, Any]:
        """JSON form (samples and their summary)."""
        return {"label": self.label, "transport": self.transport, "unit": self.unit,
                "higher_is_better": self.higher_is_better, "samples": self.samples,
                **summarize(self.samples)}


@dataclass
class Ratio:
    """``numerator / denominator`` computed per repetition, then summarized."""

    label: str
    numerator: Measure
    denominator: Measure

    @property
    def samples(self) -> list[float]:
        """One ratio per repetition in which both sides were measured."""
        return [a / b if b else math.nan
                for a, b in zip(self.numerator.samples, self.denominator.samples)]

    @property
    def median(self) -> float:
        """Median of the per-repetition ratios."""
        return summarize(self.samples)["median"]

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"label": self.label, "numerator": self.numerator.label,
                "denominator": self.denominator.label, "samples": self.samples,
                **summarize(self.samples)}
