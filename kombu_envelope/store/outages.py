"""Riding out a Redis outage: commands wait for Redis to come back, for a bounded time.

Every client the package builds (:func:`kombu_envelope.store.client.connection_kwargs`)
retries a command that failed because Redis was unreachable, restarting or still
loading its data, until ``outage_tolerance_s`` has passed since the first failure,
with a capped exponential backoff. A command is repeated only when repeating it is
safe:

* reads, acks (``XACK``/``XDEL``), liveness renewals and every script but
  ``enqueue.lua`` have the same effect when applied twice;
* ``enqueue.lua`` (the ``XADD`` of a due task) is given a publish token and
  absorbs a repeated call with the same token (docs/protocol.md, section 4);
* ``read.lua`` is repeated, but a reply lost with the connection may have
  assigned entries to the consumer that it never saw, so the channel reads its
  own pending entries again after any retried read (:func:`retries_seen` tells);
* the ``XADD`` of a non-task kombu message (an event, a remote-control command
  or reply) is repeated as it is: one of them may then arrive twice, which
  Celery's events and remote control tolerate.

A failover is an outage too (:data:`FAILOVER_ERRORS`, :func:`is_outage`): a primary
that was demoted answers ``READONLY`` (a Sentinel-managed connection then drops itself and asks the
sentinels again), a Cluster between two owners of a slot answers ``TRYAGAIN`` or
``CLUSTERDOWN``, and an old primary that lost its replicas refuses writes with
``NOREPLICAS`` when ``min-replicas-to-write`` is set; none of them ran the command, so
it is tried again. ``LOADING`` is redis-py's ``BusyLoadingError``, a connection error.

The blocking read a channel keeps on its own connection is not retried here: the
channel opens a new connection and reads again (:mod:`kombu_envelope.kombu.channel`).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest wait between two tries (seconds): a command goes through this soon at
#: most after Redis is back.
MAX_BACKOFF_S = 0.25
#: First wait after a failure (seconds).
FIRST_BACKOFF_S = 0.05

_seen = threading.local()

#: Errors that no waiting cures.
_REFUSED = (AuthenticationError, AuthorizationError)

#: Replies of a node that is not (or not yet) the primary of the keys: the command
#: did not run, and runs once the new primary is found. ``CLUSTERDOWN`` and
#: ``MASTERDOWN`` are ``ClusterDownError``; ``SlotNotCoveredError`` is a Cluster client
#: whose slot map names no owner for the key's slot (one failed and no replica took over yet).
FAILOVER_ERRORS: tuple[type[Exception], ...] = (ReadOnlyError, ClusterDownError, TryAgainError,
                                                SlotNotCoveredError)

#: Every error that means "Redis is away or changing roles": what kombu and Celery
#: must see as a connection error (the transport's ``connection_errors``).
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, socket.timeout,
    *FAILOVER_ERRORS)

#: Error replies that redis-py raises as plain response errors and that mean "not
#: now, not here": ``NOREPLICAS`` (a primary configured with ``min-replicas-to-write``
#: that lost its replicas, as an old primary does after a stall), ``UNBLOCKED`` (a
#: blocking read ended because a stream it waited on was deleted or the server
#: changed role), and the failover replies by their text.
#: (In a pipeline redis-py prefixes the reply with the command that got it.)
_OUTAGE_REPLY = re.compile(r"(?:^|of pipeline caused error: )(?:NOREPLICAS|UNBLOCKED|READONLY|"
                           r"TRYAGAIN|CLUSTERDOWN|MASTERDOWN|LOADING)\b")


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` means Redis is away or between roles (not a bad command)."""
    if isinstance(error, _REFUSED):
        return False
    if isinstance(error, OUTAGE_ERRORS):
        return True
    return isinstance(error, ResponseError) and _OUTAGE_REPLY.search(str(error)) is not None


def retries_seen() -> int:
    """How many failed tries the current thread's commands retried so far."""
    return int(getattr(_seen, "count", 0))


class WaitedForRedis(RedisConnectionError):
    """A step whose commands waited for Redis: what it read about liveness is stale."""


class AnsweredAtOnce:
    """Whether the current thread's commands since this watch began were answered at once.

    A command answered at once was neither retried through an outage
    (:func:`retries_seen`) nor answered later than ``within_s`` after the watch
    began. Liveness read after a wait is not trusted (docs/protocol.md, sections 5
    and 9): during an outage every liveness key may have expired, and live
    consumers need one renewal interval to set theirs again.
    """

    def __init__(self, within_s: float) -> None:
        self.within_s = within_s
        self._retries = retries_seen()
        self._began = time.monotonic()

    def waited(self) -> bool:
        """True when a command since the watch began waited for Redis."""
        return (retries_seen() != self._retries
                or time.monotonic() - self._began > self.within_s)

    def check(self, what: str) -> None:
        """Raise :class:`WaitedForRedis` naming ``what`` when a command waited."""
        if self.waited():
            raise WaitedForRedis(f"{what} waited for Redis; its liveness checks are not trusted")


class OutageRetry(Retry):
    """redis-py ``Retry`` bounded by time, not by count, shared by a pool's connections.

    An outage has one clock for every command of the pool: once Redis has been
    unreachable for ``tolerance_s``, each command tries once and fails at once,
    until one succeeds again. So a caller that issues many commands while Redis
    is away (a channel closing) is not held ``tolerance_s`` per command.

    Only a Redis that answered the pool before can have an outage: until then
    (a wrong address, port or TLS setting) and whenever credentials are refused,
    commands fail at once, and connecting is left to the caller's own retries
    (kombu's ``ensure_connection``, Celery's ``broker_connection_retry``).

    :param tolerance_s: how long after the first failure commands keep trying
        (seconds); 0 fails at once.
    """

    def __init__(self, tolerance_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=MAX_BACKOFF_S, base=FIRST_BACKOFF_S), -1,
                         OUTAGE_ERRORS)
        self.tolerance_s = tolerance_s
        #: When the current outage began (time.monotonic()), None while Redis answers.
        self.down_since: float | None = None
        #: Whether Redis has answered a command of this pool yet.
        self.has_answered = False

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        return self  # every connection of a pool shares the outage clock

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, OutageRetry) and other.tolerance_s == self.tolerance_s

    __hash__ = Retry.__hash__

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        """Call ``do`` until it succeeds or the outage is ``tolerance_s`` old."""
        failures = 0
        caught: tuple[type[Exception], ...] = (*self._supported_errors, ResponseError)
        while True:
            try:
                result = do()
            except caught as error:
                if not self.has_answered or not is_outage(error):
                    raise
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    if self.tolerance_s > 0:
                        logger.warning("Redis unreachable (%s); commands wait up to %.0f s "
                                       "for it to come back", error, self.tolerance_s)
                deadline = self.down_since + self.tolerance_s
                if now >= deadline:
                    raise
                _seen.count = retries_seen() + 1
                time.sleep(min(self._backoff.compute(failures), deadline - now))
            else:
                self.has_answered = True
                if self.down_since is not None:
                    logger.warning("Redis answers again after %.1f s",
                                   time.monotonic() - self.down_since)
                    self.down_since = None
                return result
