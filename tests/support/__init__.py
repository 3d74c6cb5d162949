"""Reusable helpers for the test-suite (importable as ``support``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WaitTimeoutError", "wait_for"]

T = TypeVar("T")


class WaitTimeoutError(AssertionError):
    """Raised by :func:`wait_for` when the condition never became true."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    :param timeout: seconds before giving up with :class:`WaitTimeoutError`.
    :param interval: pause between polls (seconds).
    :param message: failure text, or a callable producing it (evaluated lazily,
        e.g. to include a log tail).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            text = message() if callable(message) else message
            raise WaitTimeoutError(f"timed out after {timeout:.1f}s: {text}")
        time.sleep(min(interval, remaining))
