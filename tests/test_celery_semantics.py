"""Unchanged Celery tasks on ``envelope://`` behave as Celery documents.

One real ``celery worker`` with Celery's defaults (prefork, early acks, mingle,
gossip and heartbeat) runs the tasks of
``apps.plain_app``, which sets no ``envelope_*`` option: failures, retries,
``max_retries``, ``expires``, priorities, headers, revokes and
``Reject(requeue=True)`` as in Celery. The product's extras show only as
additions (a failure is also dead-lettered), or where an Envelope from another
language asks for them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from itertools import pairwise
from typing import Any

import pytest
import redis
from apps.plain_app import ExpectedError, create_app
from celery import Celery
from celery.exceptions import MaxRetriesExceededError, TaskRevokedError
from celery.result import AsyncResult
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import CeleryWorker

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.retrying import RETRY_POLICY_HEADER, TIERED
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher

APP = "apps.plain_app"
RESULT_TIMEOUT = 30


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": prefix}
    with CeleryWorker(APP, pool="prefork", concurrency=2, env=env) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix)
    yield app
    app.close()


def new_name() -> str:
    return uuid.uuid4().hex[:8]


def attempts(client: redis.Redis, prefix: str, name: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in client.lrange(f"{prefix}:probe:{name}", 0, -1)]


def gaps(seen: list[dict[str, Any]]) -> list[float]:
    return [later["at"] - earlier["at"] for earlier, later in pairwise(seen)]


def dead_letter_of(client: redis.Redis, prefix: str, task_id: str,
                   worker: CeleryWorker) -> dict[str, bytes]:
    [dead] = wait_for(lambda: [d for d in dead_letters(client, prefix, "celery")
                               if d.get("task_id") == task_id.encode()],
                      message=worker.log_tail)
    return dead


def publish_foreign(client: redis.Redis, prefix: str, task_type: str, **fields: Any) -> str:
    """Publish an Envelope as another language would (no ``ext.celery``); its task id."""
    envelope = Envelope.new(task_type=task_type, **fields)
    Publisher(client, Settings(key_prefix=prefix)).publish("celery", envelope)
    return envelope.task_id


# --------------------------------------------------------------------- failures


@pytest.mark.parametrize(("task", "error"), [("plain.fail", ExpectedError),
                                             ("plain.disconnected", ConnectionError)])
def test_a_task_that_raises_fails_at_once(app: Celery, worker: CeleryWorker,
                                          redis_client: redis.Redis, prefix: str, task: str,
                                          error: type[Exception]) -> None:
    name = new_name()
    result = app.tasks[task].delay(name)
    with pytest.raises(error):
        result.get(timeout=5)  # Celery's own test_fail waits 5 s
    assert result.state == "FAILURE"
    # The traceback Celery stores (and logs) is the task's, without the execution shell's
    # frames, as on any broker.
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', result.traceback)
    assert frames[-1][1] == task.removeprefix("plain."), result.traceback
    assert not [f for f in frames if f[0].endswith("execution.py")], result.traceback
    assert len(attempts(redis_client, prefix, name)) == 1
    dead = dead_letter_of(redis_client, prefix, result.id, worker)  # added, not instead
    assert (dead["failure_class"], dead["attempts"]) == (b"task_error", b"1")


def test_wrong_arguments_fail_at_once(app: Celery, worker: CeleryWorker) -> None:
    result = app.tasks["plain.add"].delay(5)  # typing=False: checked by the call only
    with pytest.raises(TypeError):
        result.get(timeout=5)
    assert result.state == "FAILURE"


# ---------------------------------------------------------------------- retries


def test_self_retry_keeps_its_countdown_and_max_retries(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    result = app.tasks["plain.retry"].delay(name, countdown=1)  # max_retries=2
    wait_for(lambda: result.state == "RETRY", timeout=5, message=worker.log_tail)
    with pytest.raises(ExpectedError):
        result.get(timeout=RESULT_TIMEOUT)
    assert result.state == "FAILURE"
    seen = attempts(redis_client, prefix, name)
    assert [(a["retries"], a["fast"]) for a in seen] == [(0, None), (1, None), (2, None)]
    assert all(gap >= 0.9 for gap in gaps(seen))
    dead = dead_letter_of(redis_client, prefix, result.id, worker)
    assert (dead["failure_class"], dead["attempts"]) == (b"task_error", b"3")


def test_a_bare_retry_waits_default_retry_delay_then_max_retries_is_exceeded(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    result = app.tasks["plain.retry_default_delay"].delay(name)  # max_retries=1, delay 1 s
    with pytest.raises(MaxRetriesExceededError):
        result.get(timeout=RESULT_TIMEOUT)
    seen = attempts(redis_client, prefix, name)
    assert [a["retries"] for a in seen] == [0, 1]
    assert 0.9 <= gaps(seen)[0] < 10


def test_autoretry_for_keeps_retry_backoff(app: Celery, worker: CeleryWorker,
                                           redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    result = app.tasks["plain.autoretry"].delay(name)  # retry_backoff=1: 1 s, then 2 s
    with pytest.raises(ExpectedError):
        result.get(timeout=RESULT_TIMEOUT)
    seen = attempts(redis_client, prefix, name)
    assert [a["retries"] for a in seen] == [0, 1, 2]
    first, second = gaps(seen)
    assert first >= 0.9 and second >= 1.9


def test_a_retry_keeps_expires_priority_and_headers(app: Celery, worker: CeleryWorker) -> None:
    retry_once = app.tasks["plain.retry_once"]
    expiring = retry_once.delay(expires=60)
    urgent = retry_once.apply_async(priority=7)
    tagged = retry_once.apply_async(headers={"x-test-header": "test-value"})
    assert expiring.get(timeout=RESULT_TIMEOUT)["retries"] == 1
    assert urgent.get(timeout=RESULT_TIMEOUT)["priority"] == 7
    assert tagged.get(timeout=RESULT_TIMEOUT)["headers"]["x-test-header"] == "test-value"


def test_a_retry_without_throw_lets_the_attempt_go_on(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    app.tasks["plain.retry_without_throw"].delay(name)
    seen = wait_for(lambda: attempts(redis_client, prefix, name)[1:] and
                    attempts(redis_client, prefix, name), message=worker.log_tail)
    assert [a["retries"] for a in seen] == [0, 1]
    worker.wait_for_log(re.compile(r"plain\.retry_without_throw\[\S+\] succeeded in \S+: 0"))


def test_reject_with_requeue_redelivers(app: Celery, worker: CeleryWorker) -> None:
    result = app.tasks["plain.reject_then_succeed"].delay()
    assert result.get(timeout=RESULT_TIMEOUT) == "second-pass"


# ---------------------------------------------------------- expires and revokes


def test_an_expired_task_is_revoked(app: Celery, worker: CeleryWorker) -> None:
    result = app.tasks["plain.add"].apply_async((1, 1), expires=utcnow() - timedelta(seconds=1))
    with pytest.raises(TaskRevokedError):
        result.get(timeout=RESULT_TIMEOUT)
    assert result.state == "REVOKED"


def test_a_revoked_task_waiting_in_the_queue_does_not_run(app: Celery,
                                                          worker: CeleryWorker) -> None:
    busy = [app.tasks["plain.sleep"].delay(1) for _ in range(4)]
    result = app.tasks["plain.add"].apply_async((1, 1))
    result.revoke()
    with pytest.raises(TaskRevokedError):
        result.get(timeout=RESULT_TIMEOUT)
    assert result.state == "REVOKED"
    for other in busy:
        other.get(timeout=RESULT_TIMEOUT)


# ------------------------------------------------ Envelopes from other languages


@pytest.mark.parametrize(("max_retries", "succeed_at", "retries"), [
    (None, 4, 4),  # unlimited: beyond the task's max_retries=2
    (5, 4, 4),
])
def test_the_max_retries_of_a_foreign_envelope_caps_celery_retries(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str,
        max_retries: int | None, succeed_at: int, retries: int) -> None:
    name = new_name()
    task_id = publish_foreign(redis_client, prefix, "plain.retry", max_retries=max_retries,
                              payload={"name": name, "countdown": 0.1,
                                       "succeed_at": succeed_at})
    assert AsyncResult(task_id, app=app).get(timeout=RESULT_TIMEOUT) == retries
    assert [a["retries"] for a in attempts(redis_client, prefix, name)] == [0, 1, 2, 3, 4]


def test_a_foreign_envelope_without_retries_is_never_retried(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    task_id = publish_foreign(redis_client, prefix, "plain.retry", max_retries=0,
                              payload={"name": name, "countdown": 0.1})
    with pytest.raises(ExpectedError):
        AsyncResult(task_id, app=app).get(timeout=RESULT_TIMEOUT)
    assert len(attempts(redis_client, prefix, name)) == 1
    dead = dead_letter_of(redis_client, prefix, task_id, worker)
    raw = {field[4:]: value for field, value in dead.items() if field.startswith("raw.")}
    assert decode_entry(raw).max_retries == 0  # never rewritten to the task's 2


def test_an_envelope_asking_for_the_tiered_policy_is_retried_automatically(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    name = new_name()
    task_id = publish_foreign(redis_client, prefix, "plain.disconnected", max_retries=2,
                              payload={"name": name}, headers={RETRY_POLICY_HEADER: TIERED})
    with pytest.raises(ConnectionError):
        AsyncResult(task_id, app=app).get(timeout=RESULT_TIMEOUT)
    seen = attempts(redis_client, prefix, name)
    assert [(a["retries"], a["fast"]) for a in seen] == [(0, None), (1, "1"), (2, "2")]
    dead = dead_letter_of(redis_client, prefix, task_id, worker)
    assert (dead["failure_class"], dead["attempts"]) == (b"transient_exhausted", b"3")
