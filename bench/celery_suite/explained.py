"""The differences explained in ``docs/celery-compatibility.md``.

The document's table between the ``celery-suite:differences`` markers has one row per
test that fails on one broker and not on the other; its first cell is the test id in
backticks (``test_tasks.py::test_tasks::test_fail``), its last the explanation.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.celery_suite import ROOT

__all__ = ["BEGIN", "DOC", "END", "ExplanationError", "explanations"]

DOC = ROOT / "docs" / "celery-compatibility.md"
BEGIN = "<!-- celery-suite:differences:begin -->"
END = "<!-- celery-suite:differences:end -->"

_ROW = re.compile(r"^\|\s*`(?P<test>[^`]+)`\s*\|(?P<cells>.*)\|\s*$")


class ExplanationError(ValueError):
    """The document has no differences table, or a row has no explanation."""


def explanations(doc: Path = DOC) -> dict[str, str]:
    """Explanation of each documented difference, by test id."""
    text = doc.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ExplanationError(f"{doc}: no table between {BEGIN} and {END}")
    found: dict[str, str] = {}
    for line in text[start + len(BEGIN):end].splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            continue
        why = match.group("cells").rsplit("|", 1)[-1].strip()
        if not why:
            raise ExplanationError(f"{doc}: `{match.group('test')}` has no explanation")
        found[match.group("test")] = why
    return found
