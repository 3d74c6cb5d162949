"""The retry policy (pure, with a fake clock and random source) and the retry slots."""

from __future__ import annotations

import socket
import threading
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery.exceptions import Reject, SoftTimeLimitExceeded, TimeLimitExceeded
from kombu.exceptions import OperationalError
from redis import exceptions as redis_errors

from celery_ext.failures import InvalidPayload, classify
from kombu_envelope.failures import FailureClass
from kombu_envelope.retrying import (
    Action,
    ErrorKind,
    RetryPolicy,
    fast_retries_taken,
    import_exception,
)
from kombu_envelope.settings import Settings
from kombu_envelope.store.retry_slots import DEFAULT_SLOT_MS, RetrySlots

NOW = datetime(2025, 9, 11, 12, 0, tzinfo=timezone.utc)
POLICY = RetryPolicy()


def clock() -> datetime:
    return NOW


def middle() -> float:
    return 0.5  # jitter factor 1.0


class AppError(Exception):
    pass


def run_until_dead_letter(kind: ErrorKind, max_retries: int | None = 5,
                          policy: RetryPolicy = POLICY, limit: int = 20) -> list[tuple[str, float]]:
    """Feed failures of ``kind`` through the policy as a worker would; the actions taken."""
    retry_count, fast, seen = 0, 0, []
    for _ in range(limit):
        decision = policy.decide(kind, retry_count=retry_count, max_retries=max_retries,
                                 fast_retries_taken=fast, rng=middle, clock=clock)
        seen.append((decision.action.value, decision.delay_s))
        if decision.action is Action.DEAD_LETTER:
            break
        retry_count, fast = decision.retry_count, decision.fast_retries
    return seen


# ------------------------------------------------------------------ the tiers


def test_transient_errors_retry_fast_then_back_off() -> None:
    assert run_until_dead_letter(ErrorKind.TRANSIENT) == [
        ("retry_now", 0.0), ("retry_now", 0.0),
        ("retry_later", 30.0), ("retry_later", 60.0), ("retry_later", 120.0),
        ("dead_letter", 0.0),
    ]


def test_task_errors_and_timeouts_skip_the_fast_tier() -> None:
    for kind in (ErrorKind.TASK_ERROR, ErrorKind.TIMEOUT):
        assert run_until_dead_letter(kind, max_retries=3) == [
            ("retry_later", 30.0), ("retry_later", 60.0), ("retry_later", 120.0),
            ("dead_letter", 0.0)]


@pytest.mark.parametrize(("kind", "failure_class"), [
    (ErrorKind.TRANSIENT, FailureClass.TRANSIENT_EXHAUSTED),
    (ErrorKind.TIMEOUT, FailureClass.TIMEOUT),
    (ErrorKind.TASK_ERROR, FailureClass.TASK_ERROR),
])
def test_exhaustion_names_the_last_error(kind: ErrorKind, failure_class: FailureClass) -> None:
    decision = POLICY.decide(kind, retry_count=3, max_retries=3, fast_retries_taken=2)
    assert decision.action is Action.DEAD_LETTER
    assert decision.failure_class is failure_class
    assert decision.attempts == 4  # retry_count + 1


@pytest.mark.parametrize(("kind", "failure_class"), [
    (ErrorKind.INVALID_PAYLOAD, FailureClass.INVALID_PAYLOAD),
    (ErrorKind.REJECTED, FailureClass.REJECTED),
])
def test_invalid_payloads_and_rejections_never_retry(kind: ErrorKind,
                                                     failure_class: FailureClass) -> None:
    decision = POLICY.decide(kind, retry_count=0, max_retries=None)
    assert (decision.action, decision.failure_class, decision.attempts) == (
        Action.DEAD_LETTER, failure_class, 1)


def test_unlimited_retries_never_dead_letter() -> None:
    decision = POLICY.decide(ErrorKind.TASK_ERROR, retry_count=10_000, max_retries=None,
                             rng=middle)
    assert decision.action is Action.RETRY_LATER
    assert decision.delay_s == POLICY.max_backoff_s


def test_zero_max_retries_dead_letters_the_first_failure() -> None:
    decision = POLICY.decide(ErrorKind.TRANSIENT, retry_count=0, max_retries=0)
    assert (decision.action, decision.attempts) == (Action.DEAD_LETTER, 1)


def test_the_delay_and_due_time_follow_the_fake_clock() -> None:
    decision = POLICY.decide(ErrorKind.TASK_ERROR, retry_count=1, max_retries=5, rng=middle,
                             clock=clock)
    assert decision.retry_count == 2
    assert decision.delay_s == 60.0  # next = 2, no fast retries: 30 * 2 ** 1
    assert decision.due_at == NOW + timedelta(seconds=60)


def test_the_fast_tier_counts_in_the_header() -> None:
    decision = POLICY.decide(ErrorKind.TRANSIENT, retry_count=0, max_retries=5,
                             fast_retries_taken=fast_retries_taken({}))
    assert (decision.action, decision.fast_retries, decision.due_at) == (
        Action.RETRY_NOW, 1, None)
    decision = POLICY.decide(ErrorKind.TRANSIENT, retry_count=1, max_retries=5,
                             fast_retries_taken=fast_retries_taken({"x-fast-retries": "1"}))
    assert decision.fast_retries == 2
    assert fast_retries_taken({"x-fast-retries": "nonsense"}) == 0
    assert fast_retries_taken(None) == 0


def test_jitter_applies_before_the_cap() -> None:
    policy = RetryPolicy(backoff_s=10, max_backoff_s=11)
    assert policy.backoff_delay(1, 0, rng=lambda: 0.0) == pytest.approx(8.0)
    assert policy.backoff_delay(1, 0, rng=lambda: 1.0) == 11  # 12 capped
    assert policy.backoff_delay(2, 0, rng=lambda: 0.0) == 11  # 16 capped
    assert policy.backoff_delay(10_000, 0, rng=lambda: 0.0) == 11  # no overflow


def test_real_randomness_stays_within_the_jitter() -> None:
    delays = {POLICY.backoff_delay(3, 0) for _ in range(200)}
    assert all(96 <= delay <= 144 for delay in delays) and len(delays) > 1


def test_a_refused_retry_backs_off_without_counting() -> None:
    decision = POLICY.reschedule(retry_count=2, fast_retries_taken=0, rng=middle, clock=clock)
    assert (decision.action, decision.retry_count, decision.fast_retries) == (
        Action.RETRY_LATER, 2, 0)
    assert decision.delay_s == 60.0  # next = retry_count = 2
    assert decision.due_at == NOW + timedelta(seconds=60)


# ----------------------------------------------------------- configuration


def test_policies_merge_over_a_base() -> None:
    base = RetryPolicy.from_config({"backoff_s": 1, "transient_exceptions": [AppError]})
    task = RetryPolicy.from_config({"retry_concurrency": 2,
                                    "transient_exceptions": ["builtins:LookupError"],
                                    "jitter": [1, 1]}, base=base)
    assert (task.backoff_s, task.retry_concurrency, task.fast_retries) == (1, 2, 2)
    assert task.jitter == (1.0, 1.0)
    assert task.is_transient(AppError()) and task.is_transient(KeyError())
    assert not base.is_transient(KeyError())
    with pytest.raises(ValueError, match="backof_s"):
        RetryPolicy.from_config({"backof_s": 1})


def test_exception_names() -> None:
    assert import_exception("socket.gaierror") is socket.gaierror
    assert import_exception("redis.exceptions:LockError") is redis_errors.LockError
    with pytest.raises(TypeError):
        import_exception("os.path")


@pytest.mark.parametrize(("exc", "kind"), [
    (ConnectionRefusedError(), ErrorKind.TRANSIENT),
    (TimeoutError(), ErrorKind.TRANSIENT),
    (socket.gaierror(), ErrorKind.TRANSIENT),
    (redis_errors.ConnectionError(), ErrorKind.TRANSIENT),
    (redis_errors.TimeoutError(), ErrorKind.TRANSIENT),
    (redis_errors.LockError(), ErrorKind.TRANSIENT),
    (OperationalError(), ErrorKind.TRANSIENT),
    (SoftTimeLimitExceeded(), ErrorKind.TIMEOUT),
    (TimeLimitExceeded(), ErrorKind.TIMEOUT),
    (InvalidPayload("no"), ErrorKind.INVALID_PAYLOAD),
    (Reject("no", requeue=False), ErrorKind.REJECTED),
    (ValueError(), ErrorKind.TASK_ERROR),
    (FileNotFoundError(), ErrorKind.TASK_ERROR),  # an OSError, not a socket error
    (AppError(), ErrorKind.TASK_ERROR),
])
def test_classification(exc: BaseException, kind: ErrorKind) -> None:
    assert classify(exc, POLICY) is kind


# ------------------------------------------------------------------ retry slots


def test_retry_slots_cap_a_task_type(redis_client: redis.Redis, key_prefix: str) -> None:
    slots = RetrySlots(redis_client, Settings(key_prefix=key_prefix))
    assert slots.take("t.a", "1", limit=2) and slots.take("t.a", "2", limit=2)
    assert not slots.take("t.a", "3", limit=2)
    assert slots.take("t.a", "1", limit=2)  # its own slot again
    assert slots.take("t.b", "3", limit=2)  # another task type
    slots.release("t.a", "1")
    assert slots.take("t.a", "3", limit=2)
    seconds, micros = redis_client.time()
    expiry = redis_client.zscore(Settings(key_prefix=key_prefix).keys.retrying("t.b"), "3")
    assert expiry == pytest.approx(seconds * 1000 + micros / 1000 + DEFAULT_SLOT_MS, abs=1000)


def test_slots_of_dead_workers_expire(redis_client: redis.Redis, key_prefix: str) -> None:
    slots = RetrySlots(redis_client, Settings(key_prefix=key_prefix))
    assert slots.take("t.a", "dead", limit=1, timeout_ms=50)
    assert not slots.take("t.a", "live", limit=1)
    threading.Event().wait(0.1)
    assert slots.take("t.a", "live", limit=1)
    assert slots.held("t.a") == 1


def test_racing_takers_never_exceed_the_cap(redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    barrier = threading.Barrier(12)
    taken: list[bool] = []

    def take(task_id: str) -> None:
        slots = RetrySlots(redis.Redis(connection_pool=redis_client.connection_pool), settings)
        barrier.wait()
        taken.append(slots.take("t.race", task_id, limit=3))

    threads = [threading.Thread(target=take, args=(str(i),)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert taken.count(True) == 3
