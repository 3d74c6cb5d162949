"""The retry policy: what happens after a failed attempt (docs/protocol.md, section 8).

Pure code: :meth:`RetryPolicy.decide` maps an error kind and the retry state of
a task to :class:`Decision` (retry now, retry later, or dead-letter). The
clock and the random source are arguments, so tests need no sleeping::

    policy = RetryPolicy(fast_retries=2, backoff_s=30, max_backoff_s=3600)
    decision = policy.decide(ErrorKind.TRANSIENT, retry_count=2, max_retries=5,
                             fast_retries_taken=2, rng=lambda: 0.5)
    # Decision(action=RETRY_LATER, delay_s=30.0, ...)

The policy applies to a task whose Envelope asks for automatic retries with
the header ``x-retry-policy: tiered`` (:func:`asks_for_tiered`); any other
failure no retry follows is :func:`not_retried`. Tiers: a transient error
retries at once while the header ``x-fast-retries`` is below ``fast_retries``;
every other retry waits ``min(backoff_s * 2 ** (next - f - 1) * j,
max_backoff_s)`` with ``f`` the fast retries taken and ``j`` uniform in
``jitter`` (applied before the cap). ``max_retries`` caps every retry, automatic
or explicit; it never turns retries on.
"""

from __future__ import annotations

import importlib
import random
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from kombu.exceptions import OperationalError
from redis import exceptions as redis_errors

from kombu_envelope.envelope import utcnow
from kombu_envelope.failures import FailureClass

#: Header counting the fast-tier retries already taken (a decimal string; absent = 0).
FAST_RETRIES_HEADER = "x-fast-retries"
#: Header holding the RFC 3339 time of a task's first failure, set on its first retry.
FIRST_FAILURE_HEADER = "x-first-failure-at"
#: Envelope header asking for automatic retries; :data:`TIERED` is the one policy defined.
RETRY_POLICY_HEADER = "x-retry-policy"
TIERED = "tiered"

#: Errors that are transient in every policy; a policy's ``transient_exceptions`` adds more.
DEFAULT_TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,  # socket.timeout too; never the task's own time limit
    socket.gaierror,
    socket.herror,
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.LockError,
    OperationalError,
)

# Exponents above this already exceed any sensible cap (and 2.0 ** 1024 overflows).
_MAX_EXPONENT = 64


class ErrorKind(str, Enum):
    """How a failed attempt is classified (docs/protocol.md, section 8)."""

    TRANSIENT = "transient"
    TIMEOUT = "timeout"
    TASK_ERROR = "task_error"
    INVALID_PAYLOAD = "invalid_payload"
    REJECTED = "rejected"


#: Kinds that are dead-lettered at once, whatever the retry count.
NEVER_RETRIED = {ErrorKind.INVALID_PAYLOAD: FailureClass.INVALID_PAYLOAD,
                 ErrorKind.REJECTED: FailureClass.REJECTED}

#: Failure class of a task whose retries ran out, by the kind of its last error.
EXHAUSTED = {ErrorKind.TRANSIENT: FailureClass.TRANSIENT_EXHAUSTED,
             ErrorKind.TIMEOUT: FailureClass.TIMEOUT,
             ErrorKind.TASK_ERROR: FailureClass.TASK_ERROR}


class Action(str, Enum):
    """What to do with a failed attempt."""

    RETRY_NOW = "retry_now"
    RETRY_LATER = "retry_later"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class Decision:
    """The outcome of :meth:`RetryPolicy.decide`.

    ``retry_count`` is the count of the next attempt, ``fast_retries`` the value
    of its ``x-fast-retries`` header, ``attempts`` the attempts made so far
    (``retry_count + 1`` of the failed one), ``due_at`` when the next attempt
    runs (None: now, or never).
    """

    action: Action
    retry_count: int
    attempts: int
    fast_retries: int
    delay_s: float = 0.0
    due_at: datetime | None = None
    failure_class: FailureClass | None = None


def asks_for_tiered(headers: Mapping[str, Any] | None) -> bool:
    """True when Envelope (or Celery) headers ask for automatic retries under this policy."""
    return (headers or {}).get(RETRY_POLICY_HEADER) == TIERED


def not_retried(kind: ErrorKind, *, retry_count: int, fast_retries_taken: int = 0) -> Decision:
    """A failure no automatic retry follows: dead-lettered as ``timeout`` or ``task_error``.

    Kinds that are never retried keep their own failure class.
    """
    failure_class = NEVER_RETRIED.get(kind) or (
        FailureClass.TIMEOUT if kind is ErrorKind.TIMEOUT else FailureClass.TASK_ERROR)
    return Decision(Action.DEAD_LETTER, retry_count, retry_count + 1, fast_retries_taken,
                    failure_class=failure_class)


def exhausted(kind: ErrorKind, *, retry_count: int, fast_retries_taken: int = 0) -> Decision:
    """A retry asked for past ``max_retries``: dead-lettered by the kind of the last error."""
    failure_class = NEVER_RETRIED.get(kind) or EXHAUSTED[kind]
    return Decision(Action.DEAD_LETTER, retry_count, retry_count + 1, fast_retries_taken,
                    failure_class=failure_class)


def fast_retries_taken(headers: Mapping[str, Any] | None) -> int:
    """The ``x-fast-retries`` header as an int (absent or unreadable: 0)."""
    value = (headers or {}).get(FAST_RETRIES_HEADER)
    try:
        return max(int(value), 0) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def import_exception(name: str) -> type[BaseException]:
    """The exception class named ``module:Class`` or ``module.Class``."""
    module, sep, attribute = name.partition(":")
    if not sep:
        module, _, attribute = name.rpartition(".")
    found = getattr(importlib.import_module(module), attribute)
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise TypeError(f"{name!r} is not an exception class")
    return found


def _exceptions(values: Iterable[type[BaseException] | str]) -> tuple[type[BaseException], ...]:
    return tuple(import_exception(v) if isinstance(v, str) else v for v in values)


@dataclass(frozen=True)
class RetryPolicy:
    """When failed attempts run again. Every language has the same defaults."""

    #: Transient errors retried at once, before the backoff tier.
    fast_retries: int = 2
    #: First backoff delay (seconds); it doubles on every backoff retry.
    backoff_s: float = 30.0
    #: Longest backoff delay (seconds), applied after the jitter.
    max_backoff_s: float = 3600.0
    #: Bounds of the random factor each backoff delay is multiplied by.
    jitter: tuple[float, float] = (0.8, 1.2)
    #: Most retries of one task type running at once across all workers.
    retry_concurrency: int = 5
    #: Transient errors besides :data:`DEFAULT_TRANSIENT_EXCEPTIONS`.
    transient_exceptions: tuple[type[BaseException], ...] = field(default=())

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None,
                    base: RetryPolicy | None = None) -> RetryPolicy:
        """``base`` (default: the defaults) with the settings of ``config`` applied.

        ``transient_exceptions`` may name classes as ``"module:Class"`` strings;
        they add to those of ``base``. Unknown keys raise ValueError.
        """
        base = base or cls()
        config = dict(config or {})
        unknown = set(config) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown retry policy settings: {sorted(unknown)}")
        if "transient_exceptions" in config:
            config["transient_exceptions"] = (
                *base.transient_exceptions, *_exceptions(config["transient_exceptions"]))
        if "jitter" in config:
            low, high = config["jitter"]
            config["jitter"] = (float(low), float(high))
        return replace(base, **config)

    def is_transient(self, exc: BaseException) -> bool:
        """True when ``exc`` is a transient error under this policy."""
        return isinstance(exc, (*DEFAULT_TRANSIENT_EXCEPTIONS, *self.transient_exceptions))

    def backoff_delay(self, next_count: int, fast_taken: int,
                      rng: Callable[[], float] = random.random) -> float:
        """Seconds before attempt ``next_count`` on the backoff tier (``rng`` in [0, 1))."""
        low, high = self.jitter
        factor = low + (high - low) * rng()
        exponent = min(next_count - fast_taken - 1, _MAX_EXPONENT)
        return float(min(self.backoff_s * 2.0 ** exponent * factor, self.max_backoff_s))

    def decide(self, kind: ErrorKind, *, retry_count: int, max_retries: int | None,
               fast_retries_taken: int = 0, rng: Callable[[], float] = random.random,
               clock: Callable[[], datetime] = utcnow) -> Decision:
        """What to do after an attempt with ``retry_count`` failed with ``kind``."""
        next_count = retry_count + 1
        if kind in NEVER_RETRIED or (max_retries is not None and next_count > max_retries):
            return exhausted(kind, retry_count=retry_count, fast_retries_taken=fast_retries_taken)
        if kind is ErrorKind.TRANSIENT and fast_retries_taken < self.fast_retries:
            return Decision(Action.RETRY_NOW, next_count, next_count, fast_retries_taken + 1)
        return self._later(next_count, next_count, next_count, fast_retries_taken, rng, clock)

    def reschedule(self, *, retry_count: int, fast_retries_taken: int = 0,
                   rng: Callable[[], float] = random.random,
                   clock: Callable[[], datetime] = utcnow) -> Decision:
        """Backoff for a retry that found every retry slot taken: its count stays."""
        return self._later(retry_count, retry_count, retry_count, fast_retries_taken, rng,
                           clock)

    def _later(self, delay_count: int, retry_count: int, attempts: int, fast_taken: int,
               rng: Callable[[], float], clock: Callable[[], datetime]) -> Decision:
        delay = self.backoff_delay(delay_count, fast_taken, rng)
        return Decision(Action.RETRY_LATER, retry_count, attempts, fast_taken, delay_s=delay,
                        due_at=clock() + timedelta(seconds=delay))
