"""Finding a Sentinel group's primary: the address a majority of the sentinels name.

redis-py's :class:`~redis.sentinel.Sentinel` trusts the first sentinel that names a
primary in good standing. Just after a failover, a sentinel that has not heard of
it yet still names the old primary, and a node that was SIGKILLed and started
again answers as a primary (with whatever it reloaded, often nothing) until the
sentinels turn it into a replica: writes sent there are lost when that happens.
:class:`MajoritySentinel` accepts an address only when more than half of the
listed sentinels name it (a sentinel listed twice counts once); until they agree,
looking up the primary fails with :class:`~redis.sentinel.MasterNotFoundError`, a
connection error, which commands ride out like any outage
(:mod:`kombu_envelope.store.outages`). A sentinel that refused the password makes that
failure an :class:`~redis.exceptions.AuthenticationError` instead: a setting to fix,
which no waiting cures.

Its connections (:class:`PrimaryConnection`) also find the primary again whenever
they reconnect: redis-py reconnects a connection that broke (a timeout, a reset,
``READONLY``) to the address it had, so a retried command would go back to the
old primary, stalled or demoted, for as long as it stays there.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from redis.backoff import NoBackoff
from redis.connection import SSLConnection
from redis.exceptions import AuthenticationError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

__all__ = ["MajoritySentinel", "PrimaryConnection", "PrimarySSLConnection"]


class PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary that asks the sentinels where it is on every connect."""

    _finding = False

    def connect_check_health(self, check_health: bool = True,
                             retry_socket_connect: bool = True) -> None:
        """Connect to the primary the sentinels name now, not to the last address."""
        if self._sock or self._finding:
            super().connect_check_health(check_health, retry_socket_connect)
            return
        self._finding = True
        try:
            self._connect_retry()  # discovers, then connect_to() lands in the branch above
        finally:
            self._finding = False


class PrimarySSLConnection(PrimaryConnection, SSLConnection):
    """:class:`PrimaryConnection` over TLS."""


#: How long asking one sentinel may take (connect, or an answer) unless the caller's
#: ``sentinel_kwargs`` or socket options say: a stalled sentinel must not hold up finding
#: the primary.
SENTINEL_TIMEOUT_S = 5.0


class MajoritySentinel(Sentinel):
    """A :class:`~redis.sentinel.Sentinel` that follows the majority of its sentinels.

    Each sentinel is asked once per lookup, within :data:`SENTINEL_TIMEOUT_S` (redis-py's
    own clients retry each failing sentinel three times with backoff, seconds per lookup
    while one of them is down); the lookup itself is retried as an outage.
    """

    def __init__(self, sentinels: Any, min_other_sentinels: int = 0,
                 sentinel_kwargs: dict[str, Any] | None = None, force_master_ip: str | None = None,
                 **connection_kwargs: Any) -> None:
        asking = {"socket_timeout": SENTINEL_TIMEOUT_S,
                  "socket_connect_timeout": SENTINEL_TIMEOUT_S,
                  **{name: value for name, value in connection_kwargs.items()
                     if name.startswith("socket_") and value is not None},
                  "retry": Retry(NoBackoff(), 0), **(sentinel_kwargs or {})}
        super().__init__(sentinels, min_other_sentinels, asking, force_master_ip,
                         **connection_kwargs)

    def discover_master(self, service_name: str) -> tuple[str, int]:
        """The primary's address that more than half of the listed sentinels name."""
        named: Counter[tuple[str, int]] = Counter()
        problems: list[str] = []
        refused = False
        listed = {_address(sentinel): sentinel for sentinel in self.sentinels}
        needed = len(listed) // 2 + 1
        for where, sentinel in listed.items():
            try:
                masters: Any = sentinel.sentinel_masters()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                refused = refused or isinstance(exc, (AuthenticationError, AuthorizationError))
                problems.append(f"{where}: {exc}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                address = (ip, int(state["port"]))
                named[address] += 1
                if named[address] >= needed:  # the others cannot change the outcome
                    return address
        message = (f"No master found for {service_name!r}: {needed} of {len(listed)} "
                   f"sentinels must name the same primary, they name {dict(named) or 'none'}"
                   + (f" ({', '.join(problems)})" if problems else ""))
        raise AuthenticationError(message) if refused else MasterNotFoundError(message)


def _address(sentinel: Any) -> str:
    where = sentinel.connection_pool.connection_kwargs
    return f"{where.get('host')}:{where.get('port')}"
