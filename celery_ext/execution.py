"""The reliable-execution shell every Celery task of an ``envelope://`` worker runs in.

At worker start, :func:`install_execution_shell` wraps each registered task's
``run`` and ``retry`` (instance attributes, the way Celery's ``autoretry_for``
does), so ``@app.task`` code stays as it is and behaves as Celery documents.
The shell adds what a task asks for (docs/protocol.md, sections 7-9):

1. a task with an ``idempotency_key`` claims it: a key already done returns
   at once (a duplicate, logged and counted), a key busy on a live worker is
   published again ``envelope_idempotency_defer`` seconds later (never run
   twice at once), a key held by a dead worker is taken over;
2. a retry under the tiered policy (:mod:`celery_ext.retry_policy`) takes one
   of the ``retry_concurrency`` slots of its task type; when all are taken it
   gives its claim back and is published again on the backoff tier, with the
   same ``retries``, without running;
3. the task runs; with the solo pool the soft time limit (``timeout_ms``) is
   enforced here (prefork enforces it itself);
4. on failure, ``self.retry()`` and ``autoretry_for`` retry as in Celery (their
   countdown, Celery's ``max_retries`` check); a plain raise fails at once,
   unless the tiered policy applies: then it is retried on the fast tier or
   with backoff, up to ``max_retries``. A failure that no retry follows goes
   to the dead-letter stream and is raised again, so the result backend
   records ``FAILURE``. What leaves the shell carries the traceback of the
   task's own frames, without the shell's, as on any broker: Celery formats,
   stores, logs and pickles that traceback (a prefork child sends it to the
   main process with the result, Celery's test worker also with the log
   record), and the shell's frames more than doubled that work.

A Redis error in steps 1 and 2, before the body runs, never fails the task:
the attempt is handed back, published again ``envelope_idempotency_defer``
seconds later without running (waiting for Redis to take it), and this
delivery is acknowledged.

A retry without its own ``max_retries`` is capped by the delivered
Envelope's ``max_retries`` when that is not the task's (see
:mod:`celery_ext.protocol`), so an Envelope with ``0`` or ``null`` keeps its
meaning. Settings: ``envelope_retry_policy`` (see
:mod:`celery_ext.retry_policy`), ``envelope_idempotency_done_ttl`` (seconds,
default 24 h), ``envelope_idempotency_defer`` (seconds, default 5) and
``envelope_execution_enabled`` (default True). Tasks named ``celery.*``
(chord unlocks, canvas helpers) are left alone.

While the delivered entry is still pending (``acks_late``, or the solo pool,
which acknowledges after the task), the one message Celery's ``Task.retry``
(or a deferral) publishes for the same task replaces that entry atomically
with ``retry.lua`` (:mod:`kombu_envelope.store.replacing`), as in every language: a
crash never runs an attempt twice. An entry taken over meanwhile is left to its
new owner and nothing is published. With early acknowledgements (other pools)
the entry is gone before the task runs, and the next attempt is published as
a new entry, as Celery does.

The start record of a run is held back for ``envelope_task_record_start_delay``
seconds (:mod:`celery_ext.start_records`): a task that ends sooner writes it with its
success, one that fails or retries first writes it on its own. The task records of a
run (docs/protocol.md, section 14) are sent without waiting for their replies
(:mod:`kombu_envelope.store.write_behind`), on one Redis and behind Sentinel without
``wait_replicas``: the ``running`` record, and a ``succeeded`` record that no
acknowledgement of this process carries (a prefork child's). Redis writes them while
the task runs. Their replies are read before anything else this process writes to the
broker on another connection (when the body raised, before a success rides an
acknowledgement, before the next task's claim or slot), so every later write about the
task follows them; a write whose reply was lost is written again then, the usual way.
A ``succeeded`` record goes on the same connection as the start record, after it, and
both replies are read together.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import wraps
from types import TracebackType
from typing import Any, NoReturn, TypeVar

from celery import signals
from celery.concurrency import get_implementation
from celery.concurrency.solo import TaskPool as SoloPool
from celery.exceptions import Ignore, Reject, Retry
from kombu.exceptions import OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_ext import metrics
from celery_ext.broker import broker_redis, broker_settings, uses_envelope_broker
from celery_ext.failures import Delivery, classify, dead_letter_task, describe
from celery_ext.headers import timeout_ms_of
from celery_ext.idempotency import KEY_HEADER, derive_idempotency_key
from celery_ext.protocol import MAX_RETRIES_HEADER
from celery_ext.retry_policy import (
    RETRY_POLICY_SETTING,
    TaskRetries,
    mark_tiered_tasks,
    task_retries,
)
from celery_ext.start_records import (
    START_DELAY_SETTING,
    HeldStart,
    StartTimer,
    start_delay_s,
    with_start,
)
from celery_ext.statistics import attempt_buffer
from celery_ext.time_limits import soft_time_limit
from kombu_envelope.envelope import format_rfc3339, parse_rfc3339, utcnow
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.kombu.settle import record_with_ack
from kombu_envelope.retrying import (
    FAST_RETRIES_HEADER,
    FIRST_FAILURE_HEADER,
    NEVER_RETRIED,
    Action,
    Decision,
    ErrorKind,
    RetryPolicy,
    asks_for_tiered,
    exhausted,
    fast_retries_taken,
    not_retried,
)
from kombu_envelope.store.idempotency import DEFAULT_DONE_TTL_S, Claim, ClaimState, Idempotency
from kombu_envelope.store.ordering import OrderingKeys, held_member
from kombu_envelope.store.replacing import PendingAttempt, Replaced, next_attempt_replaces
from kombu_envelope.store.replication import execute, write_pipeline
from kombu_envelope.store.retry_slots import RetrySlots
from kombu_envelope.store.slots import free_slot
from kombu_envelope.store.task_records import RecordWrite, TaskState, record_write, skip_write
from kombu_envelope.store.worker_stats import StatsBuffer, observation, wait_seconds
from kombu_envelope.store.write_behind import WriteBehind
from kombu_envelope.trace_context import process_span

logger = logging.getLogger(__name__)

#: Celery setting: False keeps the shell out of the worker.
ENABLED_SETTING = "envelope_execution_enabled"
#: Celery setting: seconds a done idempotency marker is kept.
DONE_TTL_SETTING = "envelope_idempotency_done_ttl"
#: Celery setting: seconds a task that could not start (key busy, Redis failing) waits.
DEFER_SETTING = "envelope_idempotency_defer"
DEFAULT_DEFER_S = 5.0

#: Errors of a Redis that failed or went away while a task was being claimed.
BROKER_ERRORS: tuple[type[BaseException], ...] = (RedisError, OperationalError, OSError)
# Errors of a Redis that is away: a step that failed with one is tried again.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OperationalError, OSError)
# Longest wait between two tries of a step while Redis is away (seconds).
_MAX_WAIT_S = 5.0

_current: ContextVar[Attempt | None] = ContextVar("envelope_attempt", default=None)
_UNSET = object()
T = TypeVar("T")


@dataclass
class Attempt:
    """One execution of a task, as the shell sees it."""

    task: Any
    request: Any
    retry: Callable[..., Any]  # the task's own Task.retry
    policy: RetryPolicy
    tiered: bool  # plain raises are retried under the policy
    max_retries: int | None  # the cap of retries without their own max_retries
    delivery: Delivery
    timeout_ms: int | None
    claim: Claim | None = None  # the idempotency claim held while the task runs
    claim_unsure: bool = False  # claim is ours only if idem_begin.lua landed (reply lost)
    settled: bool = False  # retried, deferred or dead-lettered already
    retried: bool = False  # a retry of it is being published
    pending: PendingAttempt | None = None  # its entry, while a next attempt replaces it
    dead_here: bool = False  # dead-lettered by this process, its entry acknowledged already
    start: HeldStart | None = None  # its start record, while held back

    def write_start(self) -> None:
        """Write the held start record now, before anything else about the attempt."""
        if self.start is not None:
            self.start.write_now()

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
    """Runs the tasks of one worker app through claims, slots, time limits and retries."""

    def __init__(self, app: Any, *, solo: bool = False,
                 rng: Callable[[], float] = random.random) -> None:
        """``solo``: the worker runs the solo pool, which acknowledges after the task
        (its event loop waits for it) and where the shell enforces soft time limits."""
        self.app = app
        self.settings = broker_settings(app)
        self.setting = app.conf.get(RETRY_POLICY_SETTING)
        self.done_ttl_s = float(app.conf.get(DONE_TTL_SETTING) or DEFAULT_DONE_TTL_S)
        self.defer_s = float(app.conf.get(DEFER_SETTING) or DEFAULT_DEFER_S)
        self.start_delay_s = start_delay_s(app.conf.get(START_DELAY_SETTING))
        self._starts = StartTimer(self.start_delay_s) if self.start_delay_s > 0 else None
        self.solo = solo
        self.rng = rng
        self._retries: dict[str, TaskRetries] = {}
        self._client: Any = None
        self._client_pid: int | None = None
        self._behind: WriteBehind | None = None

    @property
    def client(self) -> Any:
        """This process's Redis client on the broker (a new one after a fork), once the
        records it sent without waiting have landed: whatever it writes next follows them."""
        if self._client is None or self._client_pid != os.getpid():
            self._client = broker_redis(self.app, self.settings)
            self._client_pid = os.getpid()
            self._behind = WriteBehind.where_allowed(self._client, self.settings)
        elif self._behind is not None:
            self._behind.settle()
        return self._client

    def _records_landed(self) -> None:
        """Wait for the records this process sent without waiting (their replies)."""
        if self._writes_behind():
            self._behind.settle()  # type: ignore[union-attr]

    def _writes_behind(self) -> bool:
        """This process has its write-behind connection (its records are sent on it)."""
        return self._behind is not None and self._client_pid == os.getpid()

    def retries_for(self, task: Any) -> TaskRetries:
        """How ``task`` retries: the setting with its ``envelope_retry_policy`` option."""
        retries = self._retries.get(task.name)
        if retries is None:
            retries = self._retries[task.name] = task_retries(
                self.setting, getattr(task, RETRY_POLICY_SETTING, None))
        return retries

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
            try:
                return self.execute(task, run, retry, args, kwargs)
            except BaseException as exc:
                exc.__traceback__ = _without_shell_frames(exc.__traceback__)
                raise

        @wraps(retry)
        def shell_retry(*args: Any, **kwargs: Any) -> Any:
            return self.retry(task, retry, *args, **kwargs)

        task.run, task.retry = shell_run, shell_retry
        task._envelope_shell = self
        task.__trace__ = None  # rebuilt with the wrapped run
        return True

    # -------------------------------------------------------------- executing

    def execute(self, task: Any, run: Callable[..., Any], retry: Callable[..., Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one attempt of ``task`` (see the module documentation)."""
        request = task.request
        headers = request.headers or {}
        fallback = f"{socket.gethostname()}-{os.getpid()}"
        timeout_ms = (timeout_ms_of(request.timelimit)
                      or timeout_ms_of([task.time_limit, task.soft_time_limit]))
        retries = self.retries_for(task)
        attempt = Attempt(
            task, request, retry, retries.policy,
            tiered=retries.tiered or asks_for_tiered(headers),
            max_retries=headers.get(MAX_RETRIES_HEADER, task.max_retries),
            delivery=Delivery.of(request, fallback), timeout_ms=timeout_ms)
        token = _current.set(attempt)
        held = self._hold_key(attempt)
        done = False
        try:
            with process_span(attempt.delivery.queue, request.id, task.name, request.retries,
                              headers), self._next_attempt_replaces_entry(attempt):
                result = self._claimed(attempt, run, args, kwargs)
                done = True
                return result
        finally:
            _current.reset(token)
            self._free_slot(attempt)
            if held is not None:
                self._end_hold(attempt, held, done)
            pending = attempt.pending
            if attempt.retried and not (pending is not None and not pending.publish_if_gone
                                        and pending.outcome is Replaced.NOT_PENDING):
                self._count(attempt, {"retried": 1})

    def _next_attempt_replaces_entry(self, attempt: Attempt) -> AbstractContextManager[Any]:
        """While the entry is pending, a retry or deferral replaces it with retry.lua.

        It is pending until the task ends with ``acks_late``, and with the solo
        pool (its acknowledgement waits for the event loop, which waits for the
        task; should it have gone early, the next attempt is published anyway).
        With early acknowledgements in other pools the entry is gone already.
        """
        delivery, task = attempt.delivery, attempt.task
        if not (delivery.stream and delivery.entry_id) or not (task.acks_late or self.solo):
            return nullcontext()
        attempt.pending = PendingAttempt(
            delivery.queue, delivery.stream, delivery.entry_id, attempt.request.id,
            publish_if_gone=not task.acks_late, retry_count=attempt.request.retries)
        return next_attempt_replaces(attempt.pending)

    def _claimed(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        task, request = attempt.task, attempt.request
        claim = self._before_body(attempt, "claiming its idempotency key",
                                  lambda: self._claim(attempt))
        if claim is not None and claim.state is ClaimState.DONE:
            logger.info("task %s[%s] is a duplicate (idempotency key done: %s); not run",
                        task.name, request.id, claim.other)
            metrics.count("duplicates", task.name)
            self._count(attempt, {"duplicate": 1})
            self._record(attempt, skip_write(self.settings, attempt.delivery.queue, request.id,
                                             "duplicate"))
            return None
        if claim is not None and claim.state is ClaimState.BUSY:
            self._publish_again(attempt, self.defer_s,
                                f"its idempotency key is held by {claim.other!r}")
        attempt.claim = claim
        return self._slotted(attempt, run, args, kwargs)

    def _slotted(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        task, request = attempt.task, attempt.request
        slotted = attempt.tiered and request.retries > 0
        slots = RetrySlots(self.client, self.settings) if slotted else None
        if slots is not None and not self._before_body(
                attempt, "taking a retry slot",
                lambda: slots.take(task.name, request.id, attempt.policy.retry_concurrency,
                                   attempt.timeout_ms)):
            decision = attempt.policy.reschedule(
                retry_count=request.retries,
                fast_retries_taken=fast_retries_taken(attempt.headers), rng=self.rng)
            self._publish_again(attempt, decision.delay_s,
                                f"all {attempt.policy.retry_concurrency} retry slots are taken")
        try:
            return self._run(attempt, run, args, kwargs)
        finally:
            if slots is not None:
                try:
                    slots.release(task.name, request.id)
                except BROKER_ERRORS as exc:  # the slot expires on its own
                    logger.warning("task %s[%s]: releasing its retry slot failed: %r",
                                   task.name, request.id, exc)

    def _run(self, attempt: Attempt, run: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        limit = attempt.timeout_ms / 1000 if self.solo and attempt.timeout_ms else None
        queue, task_id = attempt.delivery.queue, attempt.request.id
        started_at = utcnow()
        if attempt.delivery.due_ms is not None:
            self._count(attempt, observation("wait", wait_seconds(
                int(started_at.timestamp() * 1000), attempt.delivery.due_ms)))
        start = record_write(
            self.settings, queue, task_id, TaskState.RUNNING,
            {"started_at": started_at, "worker": attempt.delivery.consumer,
             "language": "python", "host": socket.gethostname(), "pid": os.getpid()},
            counts_attempt=True)
        attempt.start = self._hold_start(attempt, start)
        began = time.monotonic()
        try:
            with soft_time_limit(limit):
                result = run(*args, **kwargs)
        except BaseException as exc:
            attempt.write_start()
            self._records_landed()  # the start record lands before any other write about it
            if isinstance(exc, Exception) and not isinstance(exc, Ignore):
                self._count(attempt, {**observation("run", time.monotonic() - began),
                                      "failed": 1})
            self._settle_claim(attempt, succeeded=False)
            self._failed(attempt, exc)
            raise
        self._count(attempt, {**observation("run", time.monotonic() - began), "succeeded": 1})
        self._settle_claim(attempt, succeeded=True)
        metrics.count("succeeded", attempt.task.name)
        success = record_write(self.settings, queue, task_id, TaskState.SUCCEEDED,
                               {"finished_at": utcnow()})
        if attempt.start is not None and attempt.start.take():  # ended before it was written
            success = with_start(success, start)
        delivery = attempt.delivery
        if delivery.stream and delivery.entry_id and record_with_ack(
                delivery.consumer, delivery.stream, delivery.entry_id, success):
            self._records_landed()  # before the acknowledgement, on another connection
        else:  # no ack of it waits here (section 14): sent after the start record
            self._record(attempt, success, behind=True)
        return result

    def _hold_start(self, attempt: Attempt, start: RecordWrite) -> HeldStart | None:
        """Hold the start record back for :attr:`start_delay_s` (:mod:`celery_ext.start_records`),
        or write it now (a delay of 0, records off); None when it is not held."""
        if self._starts is None or start.key is None:
            self._record(attempt, start, behind=True)
            return None
        return self._starts.hold(start, lambda record: self._record(attempt, record,
                                                                    behind=True))

    def _free_slot(self, attempt: Attempt) -> None:
        """Free the concurrency slot the attempt held (docs/protocol.md, section 19), now
        that its run ended, whether its entry is acknowledged yet or not. On a Redis error
        the slot is freed by its deadline, ``lease_ms`` after its last renewal."""
        delivery = attempt.delivery
        if delivery.slot is None:
            return
        pipe = write_pipeline(self.client, self.settings, transaction=True, key=delivery.slot)
        free_slot(pipe, delivery.slot, f"{delivery.stream} {delivery.entry_id}")
        try:
            execute(pipe, self.settings, "free slot")
        except BROKER_ERRORS as exc:
            logger.warning("task %s: freeing its concurrency slot failed (it expires on its "
                           "own): %r", _name(attempt), exc)

    def _hold_key(self, attempt: Attempt) -> str | None:
        """Hold the attempt's ordering key while it runs (docs/protocol.md, section 20):
        its acknowledgement may come first. Returns the ``order-held`` member; on a Redis
        error the key is held by the entry alone (pending until acknowledged)."""
        delivery = attempt.delivery
        if delivery.ordering_key is None or not (delivery.stream and delivery.entry_id):
            return None
        member = held_member(delivery.ordering_key, attempt.request.id, delivery.stream,
                             delivery.entry_id)
        try:
            OrderingKeys(self.client, self.settings).hold(delivery.queue, member)
        except BROKER_ERRORS as exc:
            logger.warning("task %s: holding its ordering key failed: %r", _name(attempt), exc)
        return member

    def _end_hold(self, attempt: Attempt, member: str, done: bool) -> None:
        """The run ended: the key moves on when the task is done (succeeded, or not run as
        a duplicate), halts or moves on by its policy when this process dead-lettered it
        (``dead_letter.lua`` decides for an entry still pending), else (a retry, a
        deferral, a failure still pending) keeps its head. Tried again while Redis is
        away: once acknowledged, nothing else would move the key on."""
        keys, queue = OrderingKeys(self.client, self.settings), attempt.delivery.queue
        if attempt.dead_here:
            _until_done(f"{_name(attempt)}: moving its ordering key on",
                        lambda: keys.dead(queue, member, attempt.task.name))
        else:
            _until_done(f"{_name(attempt)}: ending its ordering key's hold",
                        lambda: keys.finish(queue, member, advance=done))

    def _stats(self) -> StatsBuffer:
        return attempt_buffer(self.settings, lambda: self.client)

    def _count(self, attempt: Attempt, increments: dict[str, int]) -> None:
        """Add ``increments`` to the statistics of the attempt's queue and task type."""
        self._stats().add(attempt.delivery.queue, attempt.task.name, increments)

    def _record(self, attempt: Attempt, record: RecordWrite, *, behind: bool = False) -> None:
        """Write the task record of a step of the attempt (its start, its success, a
        duplicate) in one MULTI, with the statistics counted so far on its queue when
        they are due to ride (:meth:`StatsBuffer.ride`); a
        Redis error is logged, never a reason to fail it. ``behind``: sent without
        waiting for the reply where the client allows (:mod:`kombu_envelope.store.write_behind`)."""
        if record.key is None:
            return
        stats, queue, counted = self._stats(), attempt.delivery.queue, {}

        def failed(exc: BaseException) -> None:
            stats.give_back(queue, counted)
            logger.warning("task %s: writing its task record (%s) failed: %r", _name(attempt),
                           record.fields.get("state"), exc)

        def write() -> None:
            try:
                execute(pipe, self.settings, "task record")
            except BROKER_ERRORS as exc:
                failed(exc)

        # A write sent behind follows those pending on the same connection unread.
        client = self._client if behind and self._writes_behind() else self.client
        try:
            pipe = write_pipeline(client, self.settings, transaction=True, key=record.key)
            record.add_to(pipe)
            counted = stats.ride(pipe, queue)
        except BROKER_ERRORS as exc:
            failed(exc)
            return
        if behind and self._writes_behind():
            self._behind.send(pipe, redo=write, failed=failed)  # type: ignore[union-attr]
        else:
            write()

    # ------------------------------------------------- claims and handing back

    def _idempotency(self) -> Idempotency:
        return Idempotency(self.client, self.settings, done_ttl_s=self.done_ttl_s)

    def _settle_claim(self, attempt: Attempt, succeeded: bool) -> None:
        """Mark the attempt's key done, or release it (before a retry is published)."""
        if attempt.claim is not None:
            claim, attempt.claim = attempt.claim, None
            self._idempotency().finish(claim, succeeded=succeeded)

    def _release_claim(self, attempt: Attempt, why: str) -> None:
        """Release the attempt's key before another attempt is published, waiting for Redis."""
        if attempt.claim is not None:
            claim, unsure = attempt.claim, attempt.claim_unsure
            try:
                _until_done(f"{_name(attempt)}: releasing its idempotency key before {why}",
                            lambda: self._idempotency().finish(claim, succeeded=False,
                                                               may_not_hold=unsure))
            except BROKER_ERRORS as exc:
                if not unsure:
                    raise
                # Refused (an ACL, say), not away: the claim it may have set is left to
                # expire, as the claim step itself was refused.
                logger.warning("task %s: releasing the idempotency key its failed claim may "
                               "have set failed (%r); it expires on its own", _name(attempt), exc)
            attempt.claim, attempt.claim_unsure = None, False

    def _claim(self, attempt: Attempt) -> Claim | None:
        key = attempt.headers.get(KEY_HEADER)
        if not key:
            return None
        # The entry id tells apart two entries of one task run by two pool processes.
        holder = Idempotency.holder(attempt.delivery.consumer, attempt.request.id,
                                    attempt.delivery.entry_id)
        # Until idem_begin.lua answers, the claim may be ours: a reply lost in a failover
        # leaves it taken, and the next entry of this task (another entry id) would find it
        # busy on this live consumer until it expires. So a hand-back releases it.
        attempt.claim = Claim(ClaimState.ACQUIRED, self.settings.keys.idempotency(
            attempt.task.name, str(key)), holder)
        attempt.claim_unsure = True
        claim = self._idempotency().claim(attempt.task.name, str(key), holder,
                                          timeout_ms=attempt.timeout_ms)
        attempt.claim, attempt.claim_unsure = None, False
        return claim

    def _before_body(self, attempt: Attempt, what: str, step: Callable[[], T]) -> T:
        """``step()``; a Redis error hands the attempt back instead of failing the task."""
        try:
            return step()
        except BROKER_ERRORS as exc:
            logger.warning("task %s: Redis failed while %s (%r); handing it back",
                           _name(attempt), what, exc)
            self._publish_again(attempt, self.defer_s, f"Redis failed while {what}")

    def _publish_again(self, attempt: Attempt, countdown: float, why: str) -> NoReturn:
        """Publish the same task (same id and retries) ``countdown`` s later; Ignore this one.

        The body has not run. While Redis is away, waits and tries again: this
        delivery may be acknowledged already (early acks), so it is the last copy.
        """
        task, request = attempt.task, attempt.request
        self._release_claim(attempt, "it runs again")  # the next attempt claims it
        signature = task.signature_from_request(request, countdown=countdown)
        _until_done(f"{_name(attempt)}: publishing it again", signature.apply_async)
        attempt.settled = True
        logger.info("task %s not run now: %s; runs again in %.1f s", _name(attempt), why,
                    countdown)
        raise Ignore()

    # ---------------------------------------------------------------- failing

    def _failed(self, attempt: Attempt, exc: BaseException) -> None:
        """A failed attempt: dead-lettered, or retried under the tiered policy (raises Retry)."""
        if attempt.settled or isinstance(exc, (Retry, Ignore)) or not isinstance(exc, Exception):
            return
        request = attempt.request
        if isinstance(exc, Reject):
            if not exc.requeue:
                self._dead_letter(attempt, exc, not_retried(ErrorKind.REJECTED,
                                                            retry_count=request.retries))
            return
        metrics.count("failed", attempt.task.name)
        kind = classify(exc, attempt.policy)
        fast = fast_retries_taken(attempt.headers)
        if kind in NEVER_RETRIED or not attempt.tiered:
            self._dead_letter(attempt, exc, not_retried(kind, retry_count=request.retries,
                                                        fast_retries_taken=fast))
            return
        decision = attempt.policy.decide(kind, retry_count=request.retries,
                                         max_retries=attempt.max_retries,
                                         fast_retries_taken=fast, rng=self.rng)
        if decision.action is Action.DEAD_LETTER:
            self._dead_letter(attempt, exc, decision)
            return
        headers = ({FAST_RETRIES_HEADER: str(decision.fast_retries)}
                   if decision.action is Action.RETRY_NOW else {})
        self._retrying(attempt, "an automatic retry", headers, exc)
        self._celery_retry(attempt, None, exc=exc, countdown=decision.delay_s, headers=headers)

    def retry(self, task: Any, original: Callable[..., Any], args: Any = None,
              kwargs: Any = None, exc: BaseException | None = None, throw: bool = True,
              eta: Any = None, countdown: float | None = None, max_retries: int | None = None,
              **options: Any) -> Any:
        """``Task.retry`` as Celery does it, capped by the Envelope; dead-letters when done."""
        attempt = _current.get()
        if attempt is None or attempt.task is not task or attempt.request is not task.request:
            return original(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        attempt.write_start()  # called from the body: the start comes before the retry
        request = attempt.request
        limit = attempt.max_retries if max_retries is None else max_retries
        headers = dict(options.pop("headers", None) or {})
        if limit is not None and request.retries + 1 > limit:  # Celery's own check
            error = exc if exc is not None else sys.exc_info()[1]
            kind = classify(error, attempt.policy) if error is not None else ErrorKind.TASK_ERROR
            self._dead_letter(attempt, error, exhausted(
                kind, retry_count=request.retries,
                fast_retries_taken=fast_retries_taken(attempt.headers)))
        else:
            self._retrying(attempt, "a retry", headers, exc if exc is not None
                           else sys.exc_info()[1])
        return self._celery_retry(attempt, max_retries, args=args, kwargs=kwargs, exc=exc,
                                  throw=throw, eta=eta, countdown=countdown, headers=headers,
                                  **options)

    def _retrying(self, attempt: Attempt, what: str, headers: dict[str, Any],
                  exc: BaseException | None) -> None:
        """Before a retry is published: give the key back, carry the first failure's time
        (and the failure, for the task record)."""
        attempt.settled = attempt.retried = True
        if attempt.pending is not None and exc is not None:
            attempt.pending.error = f"{type(exc).__name__}: {exc}"
        self._release_claim(attempt, what)  # so that the retry may claim it
        headers.update({**attempt.headers, **headers})
        headers.setdefault(FIRST_FAILURE_HEADER,
                           format_rfc3339(attempt.first_failure_at(utcnow())))
        metrics.count("retried", attempt.task.name)

    def _celery_retry(self, attempt: Attempt, max_retries: int | None, **arguments: Any) -> Any:
        """Celery's ``Task.retry``; without ``max_retries`` it checks the attempt's cap.

        Celery keeps a ``max_retries`` passed to it on the task instance (for
        ``autoretry_for``); one the shell passes for the Envelope is not kept.
        """
        task, retries = attempt.task, attempt.request.retries
        if max_retries is not None or attempt.max_retries == task.max_retries:
            return attempt.retry(max_retries=max_retries, **arguments)
        kept = task.__dict__.get("override_max_retries", _UNSET)
        cap = attempt.max_retries if attempt.max_retries is not None else retries + 1
        try:
            return attempt.retry(max_retries=cap, **arguments)
        finally:
            if kept is _UNSET:
                task.__dict__.pop("override_max_retries", None)
            else:
                task.override_max_retries = kept

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
        attempt.dead_here = dead is not None and not dead.from_entry
        if dead is not None:
            self._count(attempt, {"dead": 1})
            metrics.count("dead_lettered", task.name, failure_class.value)
            logger.error("task %s dead-lettered as %s (%s): %s", _name(attempt), dead.dead_id,
                         failure_class.value, failure.reason)


def _name(attempt: Attempt) -> str:
    return f"{attempt.task.name}[{attempt.request.id}]"


def _without_shell_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame outside this module: the task's own frames, as on any
    broker (all of it when every frame is the shell's)."""
    first = tb
    while first is not None and first.tb_frame.f_globals.get("__name__") == __name__:
        first = first.tb_next
    return first if first is not None else tb


def _until_done(what: str, step: Callable[[], T]) -> T:
    """``step()``, tried again while Redis is away (waits up to 5 s between tries)."""
    wait = 0.5
    while True:
        try:
            return step()
        except _UNREACHABLE as exc:
            logger.warning("%s failed (%r); trying again in %.1f s", what, exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, _MAX_WAIT_S)


def _reason(failure_class: FailureClass, decision: Decision, exc: BaseException | None) -> str:
    error = f"{type(exc).__name__}: {exc}" if exc is not None else "no exception"
    if failure_class is FailureClass.INVALID_PAYLOAD:
        return f"invalid payload: {exc}"
    if failure_class is FailureClass.REJECTED:
        return f"rejected by the task: {getattr(exc, 'reason', exc)}"
    if decision.attempts == 1:
        return f"failed; {error}"
    return f"gave up after {decision.attempts} attempts; last {error}"


def _is_solo(pool_cls: Any) -> bool:
    try:
        found = get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    except Exception:  # an unknown pool name: the worker reports it itself
        return False
    return isinstance(found, type) and issubclass(found, SoloPool)


def shell_enabled(app: Any) -> bool:
    """Whether ``app``'s workers run tasks in the shell (``envelope_execution_enabled``)."""
    return bool(app.conf.get(ENABLED_SETTING, True))


#: The apps whose tasks this process runs in the shell (installed at worker start).
_apps_in_shell: weakref.WeakSet[Any] = weakref.WeakSet()


def runs_in_shell(app: Any) -> bool:
    """Whether this process runs ``app``'s tasks in the shell: its worker installed it.
    Not so in a process that merely imports the app (a plain kombu consumer there frees
    its slots with its acknowledgements)."""
    return app in _apps_in_shell


def install_execution_shell(sender: Any = None, **_: Any) -> ExecutionShell | None:
    """``worker_init`` receiver: run every task of the worker's app through the shell.

    Only for workers on ``envelope://``, unless ``envelope_execution_enabled`` is False.
    The setting and every task's ``envelope_retry_policy`` are checked before any
    task is wrapped: Celery logs an exception raised here (a bad policy) and
    starts the worker anyway, without the shell.
    """
    app = getattr(sender, "app", None)
    if app is None or not shell_enabled(app) or not uses_envelope_broker(app):
        return None
    shell = ExecutionShell(app, solo=_is_solo(getattr(sender, "pool_cls", None)))
    tasks = list(app.tasks.values())
    for task in tasks:
        shell.retries_for(task)  # raises on a bad policy before anything is wrapped
    installed = [task.name for task in tasks if shell.install(task)]
    _apps_in_shell.add(app)
    logger.debug("reliable execution for %d tasks: %s", len(installed), ", ".join(installed))
    return shell


#: Signal receivers to connect (``celery_ext`` does).
RECEIVERS = (
    (signals.before_task_publish, derive_idempotency_key),
    (signals.before_task_publish, mark_tiered_tasks),
    (signals.worker_init, install_execution_shell),
)
