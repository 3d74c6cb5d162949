"""The soft time limit of pools that do not enforce one (the ``solo`` pool).

The prefork pool enforces Celery's time limits itself: the soft limit raises
``SoftTimeLimitExceeded`` inside the task, the hard one kills the process. The
solo pool ignores them, so :func:`soft_time_limit` raises the same exception
from a ``SIGALRM`` timer. Signals only reach the main thread: elsewhere (the
threads pool) nothing is enforced.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from celery.exceptions import SoftTimeLimitExceeded


def can_enforce() -> bool:
    """True when this thread can receive ``SIGALRM`` (the main thread, on POSIX)."""
    return (hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread())


@contextmanager
def soft_time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``SoftTimeLimitExceeded`` in the block after ``seconds`` (None: no limit)."""
    if not seconds or seconds <= 0 or not can_enforce():
        yield
        return

    def expired(signum: int, frame: FrameType | None) -> None:
        raise SoftTimeLimitExceeded(f"soft time limit ({seconds}s) exceeded")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
