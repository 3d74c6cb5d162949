"""pytest plugin loaded into Celery's integration suite by the harness (``-p``).

Two things, and nothing that changes a test:

* when ``TEST_BROKER`` (the broker URL Celery's ``t/integration/conftest.py`` reads) is an
  ``envelope://`` or ``envelopes://`` URL, ``celery_ext`` is imported before Celery's
  conftest and tests are, as a Celery app module using that broker does. Celery's session
  worker runs in the pytest process (prefork children are forked from it), so this covers
  the worker too;
* a test is stopped after pytest-timeout's ``--timeout``: Celery's own ``timeout`` marks
  above it (its ``flaky`` helper adds 300 s) are lowered to it, so a hang is one failure,
  not a stuck run. Lower marks are kept. (A timeout inside a subtest fails that subtest
  only, and the test goes on.)
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest

#: URL schemes served by ``celery_ext``.
ENVELOPE_SCHEMES = frozenset({"envelope", "envelopes"})


def uses_envelope(broker_url: str) -> bool:
    """True when ``broker_url`` names kombu-envelope's transport."""
    return urlsplit(broker_url).scheme in ENVELOPE_SCHEMES


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Import ``celery_ext`` for an ``envelope://`` broker, before any conftest."""
    if uses_envelope(os.environ.get("TEST_BROKER", "")):
        import celery_ext  # noqa: F401  (registers envelope:// and its worker hooks)


def _marked_timeout(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return None
    value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    return None if value is None else float(value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Lower every ``timeout`` mark above ``--timeout`` to it."""
    cap = config.getoption("timeout", None)
    if not cap:
        return
    cap = float(cap)
    for item in items:
        marked = _marked_timeout(item)
        if marked is not None and (marked <= 0 or marked > cap):
            item.add_marker(pytest.mark.timeout(cap), append=False)
