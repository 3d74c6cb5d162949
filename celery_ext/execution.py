"""The reliable-execution shell every Celery task of an ``envelope://`` worker runs in.

At worker start, :func:`install_execution_shell` wraps each registered task's
``run`` and ``retry`` (instance attributes, the way Celery's ``autoretry_for``
does), so ``@app.task`` code stays as it is. Each attempt then follows
docs/protocol.md, sections 7-9:

1. a task with an ``idempotency_key`` claims it: a key already done returns
   at once (a duplicate, logged and counted), a key busy on a live worker is
   published again ``envelope_idempotency_defer`` seconds later (never run
   twice at once), a key held by a dead worker is taken over;
2. a retry (``request.retries > 0``) takes one of the ``retry_concurrency``
   slots of its task type; when all are taken it gives its claim back and is
   published again on the backoff tier, with the same ``retries``, without
   running;
3. the task runs; with the solo pool the soft time limit (``timeout_ms``) is
   enforced here (prefork enforces it itself);
4. on failure the error is classified and :class:`RetryPolicy` decides:
   retries go through ``Task.retry`` (so plain raises, ``autoretry_for`` and
   ``self.retry()`` share one ``retries`` count and the policy's countdown
   unless the task chose its own), terminal failures go to the dead-letter
   stream and the exception is raised again, so the result backend records
   ``FAILURE``.

Settings: ``envelope_retry_policy`` (a dict of :class:`RetryPolicy` fields,
also a task option merged over it), ``envelope_idempotency_done_ttl``
(seconds, default 24 h), ``envelope_idempotency_defer`` (seconds, default 5)
and ``envelope_execution_enabled`` (default True). Tasks named ``celery.*``
(chord unlocks, canvas helpers) are left alone.

Like Celery, the next attempt is published before the failed one is
acknowledged; a crash in between may run it twice, which idempotency keys make
harmless. ``Task.default_retry_delay`` is replaced by the policy.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from typing import Any, NoReturn

from celery import signals
from celery.concurrency import get_implementation
from celery.concurrency.solo import TaskPool as SoloPool
from celery.exceptions import Ignore, Reject, Retry

from celery_ext import metrics
from celery_ext.bootsteps import uses_envelope_broker
from celery_ext.broker import broker_redis, broker_settings
from celery_ext.failures import Delivery, classify, dead_letter_task, describe
from celery_ext.headers import timeout_ms_of
from celery_ext.idempotency import KEY_HEADER, derive_idempotency_key
from celery_ext.time_limits import soft_time_limit
from kombu_envelope.deadletter import Failure, FailureClass
from kombu_envelope.envelope import format_rfc3339, parse_rfc3339, utcnow
from kombu_envelope.idempotency import DEFAULT_DONE_TTL_S, Claim, ClaimState, Idempotency
from kombu_envelope.retry_slots import RetrySlots
from kombu_envelope.retrying import (
    FAST_RETRIES_HEADER,
    FIRST_FAILURE_HEADER,
    NEVER_RETRIED,
    Action,
    Decision,
    ErrorKind,
    RetryPolicy,
    fast_retries_taken,
)

logger = logging.getLogger(__name__)

#: Celery setting (and task option) holding the retry policy as a dict.
RETRY_POLICY_SETTING = "envelope_retry_policy"
#: Celery setting: False keeps the shell out of the worker.
ENABLED_SETTING = "envelope_execution_enabled"
#: Celery setting: seconds a done idempotency marker is kept.
DONE_TTL_SETTING = "envelope_idempotency_done_ttl"
#: Celery setting: seconds a task whose key is busy waits before it runs again.
DEFER_SETTING = "envelope_idempotency_defer"
DEFAULT_DEFER_S = 5.0

_current: ContextVar[Attempt | None] = ContextVar("envelope_attempt", default=None)


@dataclass
class Attempt:
    """One execution of a task, as the shell sees it."""

    task: Any
    request: Any
    policy: RetryPolicy
    delivery: Delivery
    timeout_ms: int | None
    claim: Claim | None = None  # the idempotency claim held while the task runs
    settled: bool = False  # retried, deferred or dead-lettered already

    @property
    def headers(self) -> dict[str, Any]:
        """Custom headers of the request (Envelope headers, trace id, key...)."""
        return dict(self.request.headers or {})

    def first_failure_at(self, now: datetime) -> datetime:
        """The ``x-first-failure-at`` header, or ``now`` for a first failure."""
        value = self.headers.get(FIRST_FAILURE_HEADER)
        try:
            return parse_rfc3339(value) if value else now
        except ValueError:
            return now


class ExecutionShell:
    """Runs the tasks of one worker app through slots, claims, time limits and retries."""

    def __init__(self, app: Any, *, enforce_soft_limits: bool = False,
                 rng: Callable[[], float] = random.random) -> None:
        self.app = app
        self.settings = broker_settings(app)
        self.policy = RetryPolicy.from_config(app.conf.get(RETRY_POLICY_SETTING))
        self.done_ttl_s = float(app.conf.get(DONE_TTL_SETTING) or DEFAULT_DONE_TTL_S)
        self.defer_s = float(app.conf.get(DEFER_SETTING) or DEFAULT_DEFER_S)
        self.enforce_soft_limits = enforce_soft_limits
        self.rng = rng
        self._policies: dict[str, RetryPolicy] = {}
        self._client: Any = None
        self._client_pid: int | None = None

    @property
    def client(self) -> Any:
        """This process's Redis client on the broker (a new one after a fork)."""
        if self._client is None or self._client_pid != os.getpid():
            self._client = broker_redis(self.app, self.settings)
            self._client_pid = os.getpid()
        return self._client

    def policy_for(self, task: Any) -> RetryPolicy:
        """The global policy with the task's ``envelope_retry_policy`` option applied."""
        policy = self._policies.get(task.name)
        if policy is None:
            policy = self._policies[task.name] = RetryPolicy.from_config(
                getattr(task, RETRY_POLICY_SETTING, None), base=self.policy)
        return policy

    # ------------------------------------------------------------- installing

    def install(self, task: Any) -> bool:
        """Wrap ``task.run`` and ``task.retry``; False when left alone."""
        if getattr(task, "_envelope_shell", None) is not None or task.name.startswith("celery."):
            return False
        run, retry = task.run, task.retry

        @wraps(run)
        def shell_run(*args: Any, **kwargs: Any) -> Any:
            request = task.request
            if request.called_directly or request.is_eager:
                return run(*args, **kwargs)
            return self.execute(task, run, args, kwargs)

        @wraps(retry)
        def shell_retry(*args: Any, **kwargs: Any) -> Any:
            return self.retry(task, retry, *args, **kwargs)

        task.run, task.retry = shell_run, shell_retry
        task._envelope_shell = self
        task.__trace__ = None  # rebuilt with the wrapped run
        return True

    # -------------------------------------------------------------- executing

    def execute(self, task: Any, run: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """Run one attempt of ``task`` (see the module documentation)."""
        request = task.request
        fallback = f"{socket.gethostname()}-{os.getpid()}"
        timeout_ms = (timeout_ms_of(request.timelimit)
                      or timeout_ms_of([task.time_limit, task.soft_time_limit]))
        attempt = Attempt(task, request, self.policy_for(task), Delivery.of(request, fallback),
                          timeout_ms)
        token = _current.set(attempt)
        try:
            return self._claimed(attempt, run, args, kwargs)
        finally:
            _current.reset(token)

    def _claimed(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        task, request = attempt.task, attempt.request
        claim = self._claim(attempt)
        if claim is not None and claim.state is ClaimState.DONE:
            logger.info("task %s[%s] is a duplicate (idempotency key done: %s); not run",
                        task.name, request.id, claim.other)
            metrics.count("duplicates", task.name)
            return None
        if claim is not None and claim.state is ClaimState.BUSY:
            self._publish_again(attempt, self.defer_s,
                                f"its idempotency key is held by {claim.other!r}")
        attempt.claim = claim
        return self._slotted(attempt, run, args, kwargs)

    def _slotted(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        task, request = attempt.task, attempt.request
        slots = RetrySlots(self.client, self.settings)
        slotted = request.retries > 0
        if slotted and not slots.take(task.name, request.id, attempt.policy.retry_concurrency,
                                      attempt.timeout_ms):
            self._settle_claim(attempt, succeeded=False)  # the rescheduled attempt claims again
            decision = attempt.policy.reschedule(
                retry_count=request.retries,
                fast_retries_taken=fast_retries_taken(attempt.headers), rng=self.rng)
            self._publish_again(attempt, decision.delay_s,
                                f"all {attempt.policy.retry_concurrency} retry slots are taken")
        try:
            return self._run(attempt, run, args, kwargs)
        finally:
            if slotted:
                slots.release(task.name, request.id)

    def _run(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        limit = attempt.timeout_ms / 1000 if self.enforce_soft_limits and attempt.timeout_ms \
            else None
        try:
            with soft_time_limit(limit):
                result = run(*args, **kwargs)
        except BaseException as exc:
            self._settle_claim(attempt, succeeded=False)
            self._failed(attempt, exc)
            raise
        self._settle_claim(attempt, succeeded=True)
        metrics.count("succeeded", attempt.task.name)
        return result

    def _idempotency(self) -> Idempotency:
        return Idempotency(self.client, self.settings, done_ttl_s=self.done_ttl_s)

    def _settle_claim(self, attempt: Attempt, succeeded: bool) -> None:
        """Mark the attempt's key done, or release it (before a retry is published)."""
        if attempt.claim is not None:
            claim, attempt.claim = attempt.claim, None
            self._idempotency().finish(claim, succeeded=succeeded)

    def _claim(self, attempt: Attempt) -> Claim | None:
        key = attempt.headers.get(KEY_HEADER)
        if not key:
            return None
        holder = Idempotency.holder(attempt.delivery.consumer, attempt.request.id)
        return self._idempotency().claim(attempt.task.name, str(key), holder,
                                         timeout_ms=attempt.timeout_ms)

    def _publish_again(self, attempt: Attempt, countdown: float, why: str) -> NoReturn:
        """Publish the same task (same id and retries) ``countdown`` s later; Ignore this one."""
        task, request = attempt.task, attempt.request
        task.signature_from_request(request, countdown=countdown).apply_async()
        attempt.settled = True
        logger.info("task %s[%s] not run now: %s; runs again in %.1f s", task.name,
                    request.id, why, countdown)
        raise Ignore()

    # ---------------------------------------------------------------- failing

    def _failed(self, attempt: Attempt, exc: BaseException) -> None:
        """Classify a failed attempt; retry (raises Retry) or dead-letter it."""
        if attempt.settled or isinstance(exc, (Retry, Ignore)) or not isinstance(exc, Exception):
            return
        task = attempt.task
        if isinstance(exc, Reject):
            if not exc.requeue:
                self._dead_letter(attempt, exc, self._decide(attempt, ErrorKind.REJECTED, None))
            return
        metrics.count("failed", task.name)
        kind = classify(exc, attempt.policy)
        if kind in NEVER_RETRIED:
            self._dead_letter(attempt, exc, self._decide(attempt, kind, None))
            return
        task.retry(exc=exc)  # the shell's retry: raises Retry, or exc once dead-lettered

    def _decide(self, attempt: Attempt, kind: ErrorKind, max_retries: int | None) -> Decision:
        limit = attempt.task.max_retries if max_retries is None else max_retries
        return attempt.policy.decide(kind, retry_count=attempt.request.retries,
                                     max_retries=limit,
                                     fast_retries_taken=fast_retries_taken(attempt.headers),
                                     rng=self.rng)

    def retry(self, task: Any, original: Callable[..., Any], args: Any = None,
              kwargs: Any = None, exc: BaseException | None = None, throw: bool = True,
              eta: Any = None, countdown: float | None = None, max_retries: int | None = None,
              **options: Any) -> Any:
        """``Task.retry`` under the policy: its countdown unless the task chose one."""
        attempt = _current.get()
        if attempt is None or attempt.task is not task or attempt.request is not task.request:
            return original(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        error = exc if exc is not None else sys.exc_info()[1]
        kind = classify(error, attempt.policy) if error is not None else ErrorKind.TASK_ERROR
        decision = self._decide(attempt, kind, max_retries)
        if decision.action is Action.DEAD_LETTER:
            self._dead_letter(attempt, error, decision)
            if error is not None:
                raise error
            raise task.MaxRetriesExceededError(
                f"Can't retry {task.name}[{attempt.request.id}]: no retries left")
        headers = {**attempt.headers, **(options.pop("headers", None) or {})}
        headers.setdefault(FIRST_FAILURE_HEADER, format_rfc3339(attempt.first_failure_at(utcnow())))
        if eta is None and countdown is None:
            countdown = decision.delay_s
            if decision.action is Action.RETRY_NOW:
                headers[FAST_RETRIES_HEADER] = str(decision.fast_retries)
        attempt.settled = True
        self._settle_claim(attempt, succeeded=False)  # so that the retry may claim it
        metrics.count("retried", task.name)
        return original(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers,
                        **options)

    def _dead_letter(self, attempt: Attempt, exc: BaseException | None,
                     decision: Decision) -> None:
        task, request = attempt.task, attempt.request
        failure_class = decision.failure_class or FailureClass.TASK_ERROR
        now = utcnow()
        exception_type, traceback = describe(exc) if exc is not None else (None, None)
        failure = Failure(failure_class, _reason(failure_class, decision, exc), exception_type,
                          traceback, attempts=decision.attempts,
                          first_failure_at=attempt.first_failure_at(now), last_failure_at=now,
                          task_id=request.id, task_type=task.name)
        dead = dead_letter_task(self.client, self.settings, task=task, request=request,
                                delivery=attempt.delivery, failure=failure)
        attempt.settled = True
        if dead is not None:
            metrics.count("dead_lettered", task.name, failure_class.value)
            logger.error("task %s[%s] dead-lettered as %s (%s): %s", task.name, request.id,
                         dead, failure_class.value, failure.reason)


def _reason(failure_class: FailureClass, decision: Decision, exc: BaseException | None) -> str:
    error = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception"
    if failure_class is FailureClass.INVALID_PAYLOAD:
        return f"invalid payload: {exc}"
    if failure_class is FailureClass.REJECTED:
        return f"rejected by the task: {getattr(exc, 'reason', exc)}"
    return f"gave up after {decision.attempts} attempts; last {error}"


def _is_solo(pool_cls: Any) -> bool:
    try:
        found = get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    except Exception:  # an unknown pool name: the worker reports it itself
        return False
    return isinstance(found, type) and issubclass(found, SoloPool)


def install_execution_shell(sender: Any = None, **_: Any) -> ExecutionShell | None:
    """``worker_init`` receiver: run every task of the worker's app through the shell.

    Only for workers on ``envelope://``, unless ``envelope_execution_enabled`` is False.
    Every task's ``envelope_retry_policy`` is checked before any task is wrapped:
    Celery logs an exception raised here (a bad policy) and starts the worker
    anyway, without the shell.
    """
    app = getattr(sender, "app", None)
    if app is None or not app.conf.get(ENABLED_SETTING, True) or not uses_envelope_broker(app):
        return None
    shell = ExecutionShell(app, enforce_soft_limits=_is_solo(getattr(sender, "pool_cls", None)))
    tasks = list(app.tasks.values())
    for task in tasks:
        shell.policy_for(task)  # raises on a bad option before anything is wrapped
    installed = [task.name for task in tasks if shell.install(task)]
    logger.debug("reliable execution for %d tasks: %s", len(installed), ", ".join(installed))
    return shell


#: Signal receivers to connect (``celery_ext`` does).
RECEIVERS = (
    (signals.before_task_publish, derive_idempotency_key),
    (signals.worker_init, install_execution_shell),
)
