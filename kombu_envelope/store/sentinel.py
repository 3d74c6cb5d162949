"""Finding a Sentinel group's primary: the address a majority of the sentinels name.

redis-py's :class:`~redis.sentinel.Sentinel` trusts the first sentinel that names a
primary in good standing. Just after a failover, a sentinel that has not heard of
it yet still names the old primary, and a node that was SIGKILLed and started
again answers as a primary (with whatever it reloaded, often nothing) until the
sentinels turn it into a replica: writes sent there are lost when that happens.
:class:`MajoritySentinel` accepts an address only when more than half of the
listed sentinels name it; until they agree, looking up the primary fails with
:class:`~redis.sentinel.MasterNotFoundError`, a connection error, which commands
ride out like any outage (:mod:`kombu_envelope.store.outages`).

Its connections (:class:`PrimaryConnection`) also find the primary again whenever
they reconnect: redis-py reconnects a connection that broke (a timeout, a reset,
``READONLY``) to the address it had, so a retried command would go back to the
old primary, stalled or demoted, for as long as it stays there.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from redis.connection import SSLConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
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


class MajoritySentinel(Sentinel):
    """A :class:`~redis.sentinel.Sentinel` that follows the majority of its sentinels."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        """The primary's address that more than half of the listed sentinels name."""
        named: Counter[tuple[str, int]] = Counter()
        problems: list[str] = []
        for sentinel in self.sentinels:
            try:
                masters: Any = sentinel.sentinel_masters()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                where = sentinel.connection_pool.connection_kwargs
                problems.append(f"{where.get('host')}:{where.get('port')}: {exc}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                named[(ip, int(state["port"]))] += 1
        needed = len(self.sentinels) // 2 + 1
        if named:
            address, votes = named.most_common(1)[0]
            if votes >= needed:
                return address
        raise MasterNotFoundError(
            f"No master found for {service_name!r}: {needed} of {len(self.sentinels)} "
            f"sentinels must name the same primary, they name {dict(named) or 'none'}"
            + (f" ({', '.join(problems)})" if problems else ""))
