"""Worker statistics of Celery attempts (docs/protocol.md, section 17).

The execution shell counts each attempt's outcome, run time and wait in the buffer of
the process that ran it (a prefork child has its own): the counts ride on an attempt's
task record ``MULTI`` at most once a second per queue
(:data:`~kombu_envelope.store.worker_stats.RIDE_EVERY_S`), and a timer in that process
writes what is left every liveness renewal period (``lease_ms / 3``). A child writes its last counts
when it exits (``worker_process_shutdown``), the main process when the worker stops
(``worker_shutdown``). A failed write is kept for the next one and never fails a task.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from celery import signals

from kombu_envelope.settings import Settings
from kombu_envelope.store.worker_stats import Flusher, StatsBuffer, process_buffer

_flushers: dict[int, Flusher] = {}
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    """A fork may copy the lock held by another thread: the child starts with a free one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def attempt_buffer(settings: Settings, client: Callable[[], Any]) -> StatsBuffer:
    """This process's buffer for ``settings``, with its timer started (``client()`` gives
    the Redis client it writes with)."""
    buffer = process_buffer(settings)
    with _lock:
        if os.getpid() not in _flushers:
            _flushers[os.getpid()] = Flusher(buffer, client, settings.lease_ms / 3000).start()
    return buffer


def flush_at_exit(**_: Any) -> None:
    """``worker_process_shutdown`` and ``worker_shutdown`` receiver: stop this process's
    timer and write its last counts."""
    with _lock:
        flusher = _flushers.pop(os.getpid(), None)
    if flusher is not None:
        flusher.stop()


#: Signal receivers to connect (``celery_ext`` does).
RECEIVERS = (
    (signals.worker_process_shutdown, flush_at_exit),
    (signals.worker_shutdown, flush_at_exit),
)
