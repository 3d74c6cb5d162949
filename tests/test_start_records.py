"""Start records held back for a moment (celery_ext.start_records): the timer and the
setting. The worker's records themselves are read in test_task_records.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
from celery import Celery

from celery_ext.execution import ExecutionShell
from celery_ext.start_records import (
    DEFAULT_START_DELAY_S,
    START_DELAY_SETTING,
    StartTimer,
    start_delay_s,
    with_start,
)
from kombu_envelope.store.task_records import RecordWrite

START = RecordWrite("q:task:t1", {"state": "running", "updated_at": "a", "started_at": "a",
                                  "worker": "w1"}, 604_800_000, counts_attempt=True)


class Writes:
    """The records a timer wrote, and from which thread."""

    def __init__(self) -> None:
        self.records: list[RecordWrite] = []
        self.threads: list[str] = []
        self.written = threading.Event()

    def __call__(self, record: RecordWrite) -> None:
        self.records.append(record)
        self.threads.append(threading.current_thread().name)
        self.written.set()


def test_a_start_taken_before_it_is_due_is_never_written() -> None:
    timer, writes = StartTimer(0.05), Writes()
    held = timer.hold(START, writes)
    assert held.take()  # the task ended first: its outcome carries the start
    assert not writes.written.wait(0.3)
    held.write_now()  # a failure after the take writes nothing more
    assert writes.records == []


def test_a_start_still_held_when_due_is_written_once_by_the_timer() -> None:
    timer, writes = StartTimer(0.05), Writes()
    began = time.monotonic()
    held = timer.hold(START, writes)
    assert writes.written.wait(2)
    assert time.monotonic() - began >= 0.05
    assert writes.records == [START] and writes.threads == ["kombu-envelope-start-records"]
    assert not held.take()  # written: the outcome goes on its own
    held.write_now()
    time.sleep(0.15)
    assert writes.records == [START]


def test_a_failure_writes_the_start_at_once_and_the_timer_not_again() -> None:
    timer, writes = StartTimer(0.05), Writes()
    held = timer.hold(START, writes)
    held.write_now()
    assert writes.threads == [threading.current_thread().name]
    time.sleep(0.15)
    assert writes.records == [START] and not held.take()


def test_the_timer_goes_on_in_a_forked_child() -> None:
    timer, writes = StartTimer(0.05), Writes()
    timer.hold(START, writes).take()  # the parent's thread runs
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no thread was copied; holding starts its own
        child = Writes()
        timer.hold(START, child)
        os.write(write, b"1" if child.written.wait(2) else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_the_outcome_carries_the_start_fields_under_its_own() -> None:
    success = RecordWrite("q:task:t1", {"state": "succeeded", "updated_at": "b",
                                        "finished_at": "b"}, 3_600_000)
    merged = with_start(success, START)
    assert merged.fields == {"state": "succeeded", "updated_at": "b", "started_at": "a",
                             "worker": "w1", "finished_at": "b"}
    assert merged.counts_attempt and merged.ttl_ms == 3_600_000 and merged.key == START.key


@pytest.mark.parametrize(("setting", "delay"), [(None, DEFAULT_START_DELAY_S), (0, 0.0),
                                                ("0.5", 0.5), (2, 2.0)])
def test_the_setting_gives_the_delay(setting: object, delay: float) -> None:
    assert start_delay_s(setting) == delay


@pytest.mark.parametrize("setting", [-1, "soon", float("nan"), [0.1]])
def test_a_bad_setting_is_refused_by_name(setting: object) -> None:
    with pytest.raises(ValueError, match=START_DELAY_SETTING):
        start_delay_s(setting)


def test_a_delay_of_zero_writes_every_start_before_the_body() -> None:
    app = Celery("starts", broker="envelope://127.0.0.1:1/0", set_as_current=False)
    app.conf[START_DELAY_SETTING] = 0
    assert ExecutionShell(app)._starts is None
    app.conf[START_DELAY_SETTING] = 0.2
    assert ExecutionShell(app).start_delay_s == 0.2
