"""Start records held back for a moment (docs/protocol.md, section 14).

A task's ``running`` record costs a write of its own: one more ``MULTI`` sent and run,
per task. Most tasks end sooner than anybody reads their record, so the shell holds
the start record back for ``envelope_task_record_start_delay`` seconds (default 0.1):

* a task still running then gets it from this process's :class:`StartTimer` thread,
  which looks at the held records every half delay (so within 1.5 delays);
* a task whose body returns first has the start's fields and its ``attempts``
  increment written in the same ``MULTI`` as its ``succeeded`` record
  (:func:`with_start`): one write instead of two, and ``running`` is never seen;
* a task whose body raises gets its start record first (:meth:`HeldStart.write_now`),
  before its retry, deferral or dead letter writes anything about it.

A held start and the timer's write of it are one step under the hold's lock, so the
outcome is never written before a start the timer is sending. A worker killed within
the delay leaves no start record: the task reads ``queued``, as a ``running`` record of
a dead worker does. A delay of 0 writes every start record before the body runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from kombu_envelope.store.task_records import RecordWrite

__all__ = ["DEFAULT_START_DELAY_S", "START_DELAY_SETTING", "HeldStart", "StartTimer",
           "start_delay_s", "with_start"]

#: Celery setting: seconds a start record is held back (0: written before the body).
START_DELAY_SETTING = "envelope_task_record_start_delay"
DEFAULT_START_DELAY_S = 0.1
# Seconds the timer thread keeps looking after the last held record went.
_LINGER_S = 1.0

logger = logging.getLogger(__name__)


def start_delay_s(setting: object) -> float:
    """The delay the setting gives (None: the default); a ValueError names the setting."""
    if setting is None:
        return DEFAULT_START_DELAY_S
    try:
        delay = float(setting)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        delay = -1.0
    if not delay >= 0:  # NaN too
        raise ValueError(f"{START_DELAY_SETTING} must be a number of seconds, 0 or more; "
                         f"got {setting!r}")
    return delay


class HeldStart:
    """One start record held back; written by whoever takes it first."""

    def __init__(self, record: RecordWrite, write: Callable[[RecordWrite], None],
                 due: float) -> None:
        self.record = record
        self.due = due  # time.monotonic() after which the timer writes it
        self._write = write
        self._lock = threading.Lock()
        self._taken = False

    def take(self) -> bool:
        """Take the record to write it with the outcome: False when it was written
        already (the timer's write is complete when this returns)."""
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def write_now(self) -> None:
        """Write the record now, unless it was written already."""
        with self._lock:
            if not self._taken:
                self._taken = True
                self._write(self.record)

    @property
    def taken(self) -> bool:
        """Written, or taken for the outcome's write."""
        return self._taken


class StartTimer:
    """Holds start records back; a thread in each process that holds one writes those
    still held when due."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        # One per process: a fork copies neither the thread nor (safely) a lock.
        self._by_pid: dict[int, _ProcessTimer] = {}

    def hold(self, record: RecordWrite, write: Callable[[RecordWrite], None]) -> HeldStart:
        """Hold ``record`` back; ``write(record)`` writes it (from the timer thread, or
        from :meth:`HeldStart.write_now`)."""
        held = HeldStart(record, write, time.monotonic() + self.delay_s)
        pid = os.getpid()
        timer = self._by_pid.get(pid)
        if timer is None:  # setdefault: one wins when two threads start at once
            timer = self._by_pid.setdefault(pid, _ProcessTimer(self.delay_s / 2))
        timer.add(held)
        return held


class _ProcessTimer:
    """The thread of one process: every ``period_s`` it writes the held records that are
    due; it sleeps once nothing was held for :data:`_LINGER_S`."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._held: list[HeldStart] = []
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._idle = False

    def add(self, held: HeldStart) -> None:
        with self._changed:
            self._held.append(held)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kombu-envelope-start-records")
                self._thread.start()
            elif self._idle:
                self._idle = False
                self._changed.notify()

    def _run(self) -> None:
        quiet_since = time.monotonic()
        while True:
            with self._changed:
                self._held = [held for held in self._held if not held.taken]
                if self._held:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= _LINGER_S:
                    self._idle = True
                    while self._idle:
                        self._changed.wait()
                    quiet_since = time.monotonic()
                now = time.monotonic()
                due = [held for held in self._held if held.due <= now]
            for held in due:
                try:
                    held.write_now()
                except Exception:  # the writer logs Redis errors itself: this is a bug
                    logger.exception("writing a held start record failed")
            time.sleep(self.period_s)


def with_start(outcome: RecordWrite, start: RecordWrite) -> RecordWrite:
    """``outcome``'s write with ``start``'s fields under its own (its ``state``, its
    ``updated_at``) and the ``attempts`` increment of the start."""
    return replace(outcome, fields={**start.fields, **outcome.fields}, counts_attempt=True)
