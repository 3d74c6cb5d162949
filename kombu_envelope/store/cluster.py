"""The Redis Cluster client: commands that ride out a failover, and per-slot connections.

redis-py's :class:`~redis.cluster.RedisCluster` follows ``MOVED`` and ``ASK`` itself
and refreshes its slot map after a connection error or ``CLUSTERDOWN``, but it gives
up after a fixed number of immediate tries, fewer than a failover takes (a replica
is promoted about two ``cluster-node-timeout`` after its primary went silent).
:class:`EnvelopeCluster` retries those errors for ``outage_tolerance_s``, on the
same outage clock as the other clients (:class:`~kombu_envelope.store.outages.OutageRetry`):
every command the store sends is safe to repeat (docs/protocol.md, section 5, outages).

:func:`connection_for` gives the blocking reader of a queue its own connection to
the node that owns the queue's slot, on one Redis and on a Cluster alike.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.connection import Connection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    SlotNotCoveredError,
    TryAgainError,
)

from kombu_envelope.store.outages import OutageRetry

__all__ = ["CLUSTER_REDIRECTS", "EnvelopeCluster", "connection_for", "forget_slot_owner"]

#: Replies of a node that does not (or not yet) serve a key's slot: the caller asks
#: the cluster where the slot is now and tries again.
CLUSTER_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError, SlotNotCoveredError)


class EnvelopeCluster(RedisCluster):
    """A :class:`RedisCluster` whose commands wait out a failover for ``tolerance_s``."""

    def __init__(self, *args: Any, tolerance_s: float, **kwargs: Any) -> None:
        self.outage = OutageRetry(tolerance_s)
        self.outage.update_supported_errors([ClusterDownError, SlotNotCoveredError,
                                             TryAgainError])
        super().__init__(*args, **kwargs)
        # The Cluster answered: its slot map was read from a seed. A client made while a
        # node fails over (a reconnection) waits the failover out from its first command.
        self.outage.has_answered = True

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """Run a command as redis-py does, again while the cluster fails over."""
        run = super().execute_command
        return self.outage.call_with_retry(lambda: run(*args, **kwargs), lambda _error: None)


def connection_for(client: Any, key: str) -> Connection:
    """A new, connected connection (not from any pool's free list) to the primary that
    serves ``key``: the socket of a blocking read."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        if node.redis_connection is None:
            client.nodes_manager.initialize()
            node = client.get_node_from_key(key)
        pool = node.redis_connection.connection_pool
    else:
        pool = client.connection_pool
    connection: Connection = pool.make_connection()
    connection.connect()
    return connection


def forget_slot_owner(client: Any) -> None:
    """After a redirect or a lost node, read the Cluster's slot map again (one Redis:
    nothing to do)."""
    if isinstance(client, RedisCluster):
        try:
            client.nodes_manager.initialize()
        except redis.RedisError:  # every seed unreachable for now: the next try asks again
            pass
