"""Which Celery tasks ask for the tiered retry policy (pure logic, no Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_ext.retry_policy import asks_for_tiered_retries, mark_tiered_tasks, task_retries
from kombu_envelope.failures import FailureClass
from kombu_envelope.retrying import (
    RETRY_POLICY_HEADER,
    TIERED,
    Action,
    ErrorKind,
    asks_for_tiered,
    exhausted,
    not_retried,
)


@pytest.mark.parametrize(("setting", "option", "asks"), [
    (None, None, False),  # Celery's behaviour by default
    (False, None, False),
    (True, None, True),
    ({}, None, True),  # a dict of keys asks for it too
    ({"backoff_s": 5}, None, True),
    (None, True, True),
    (None, {"fast_retries": 0}, True),
    (True, False, False),  # the task option turns the setting's policy off
    ({"backoff_s": 5}, None, True),
])
def test_what_asks_for_the_tiered_policy(setting: Any, option: Any, asks: bool) -> None:
    assert asks_for_tiered_retries(setting, option) is asks
    assert task_retries(setting, option).tiered is asks


def test_the_task_option_is_merged_over_the_setting() -> None:
    retries = task_retries({"backoff_s": 5, "fast_retries": 1}, {"fast_retries": 0})
    assert (retries.policy.backoff_s, retries.policy.fast_retries) == (5, 0)
    off = task_retries({"backoff_s": 5}, False)
    assert not off.tiered and off.policy.backoff_s == 5  # kept for an Envelope that asks


@pytest.mark.parametrize("value", ["tiered", 1, ["backoff_s"]])
def test_a_bad_value_is_refused(value: Any) -> None:
    with pytest.raises(TypeError, match="envelope_retry_policy"):
        task_retries(value, None)
    with pytest.raises(TypeError, match="task option"):
        task_retries(None, value)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("policy", broker="memory://", set_as_current=True)
    app.conf.envelope_retry_policy = True

    @app.task(name="policy.plain", shared=False)
    def plain() -> None:
        return None

    @app.task(name="policy.off", shared=False, envelope_retry_policy=False)
    def off() -> None:
        return None

    app.finalize()  # registers the tasks, as publishing them does
    yield app
    app.close()


def marked(sender: str, **headers: str) -> dict[str, str]:
    mark_tiered_tasks(sender=sender, headers=headers)
    return headers


def test_the_producer_marks_the_tasks_that_ask(app: Celery) -> None:
    assert marked("policy.plain") == {RETRY_POLICY_HEADER: TIERED}
    assert marked("policy.unknown") == {RETRY_POLICY_HEADER: TIERED}  # the setting asks
    assert marked("policy.off") == {}
    assert marked("celery.chord_unlock") == {}  # left alone by the shell too
    assert marked("policy.off", **{RETRY_POLICY_HEADER: TIERED}) == {RETRY_POLICY_HEADER: TIERED}
    app.conf.envelope_retry_policy = None
    assert marked("policy.plain") == {}


def test_a_producer_that_publishes_by_name_before_finalizing_sees_the_task_options() -> None:
    # send_task() from a web process: nothing touched the app's tasks yet.
    app = Celery("by-name", broker="memory://", set_as_current=True)
    app.conf.envelope_retry_policy = True

    @app.task(name="by-name.off", shared=False, envelope_retry_policy=False)
    def off() -> None:
        return None

    assert not app.finalized
    assert marked("by-name.off") == {}
    assert app.finalized
    app.close()


def test_the_header_and_the_decisions_without_retries() -> None:
    assert asks_for_tiered({RETRY_POLICY_HEADER: TIERED})
    assert not asks_for_tiered({RETRY_POLICY_HEADER: "other"}) and not asks_for_tiered(None)
    decision = not_retried(ErrorKind.TRANSIENT, retry_count=2)
    assert (decision.action, decision.failure_class, decision.attempts) == (
        Action.DEAD_LETTER, FailureClass.TASK_ERROR, 3)
    assert not_retried(ErrorKind.TIMEOUT, retry_count=0).failure_class is FailureClass.TIMEOUT
    assert not_retried(ErrorKind.REJECTED, retry_count=0).failure_class is FailureClass.REJECTED
    assert exhausted(ErrorKind.TRANSIENT, retry_count=3).failure_class is \
        FailureClass.TRANSIENT_EXHAUSTED
    assert exhausted(ErrorKind.INVALID_PAYLOAD, retry_count=0).failure_class is \
        FailureClass.INVALID_PAYLOAD
