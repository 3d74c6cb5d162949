"""Writes whose replies are read later: a worker's task records and an event loop's
acknowledgements (:mod:`kombu_envelope.kombu.settle`), sent without waiting.

A worker writes a task's ``running`` record before the task runs and, where the
acknowledgement does not carry it, its ``succeeded`` record after (docs/protocol.md,
section 14). The worker needs neither reply to go on, yet waiting for each costs a
round trip per write, during which the worker does nothing while Redis runs it on the
other core. A :class:`WriteBehind` sends a transaction's commands (``MULTI`` ...
``EXEC``) on a connection it holds and returns at once. Redis runs them while the task
runs; their replies are read by :meth:`settle`, which the writer calls before it writes
anything else about the same task on another connection (one connection's commands run
in order, not two connections'), or once :data:`MAX_UNREAD` writes wait for theirs. A
task's ``running`` and ``succeeded`` records so go one after the other, and their replies
are read together (one read of the socket, not two).

Nothing is given up against waiting for the reply:

* bytes the kernel has taken are sent even if the process dies next, as a write whose
  reply is awaited would have been;
* a write that cannot be sent (no connection) or whose reply is lost with the
  connection (Redis restarted, a failover) is handed back to its ``redo``, which
  writes it again the usual way, with the client's retry while Redis is away, and
  before any later write of this process about that task;
* an error reply (a refused command) goes to ``failed``, as an error of a waited-for
  write would have been raised.

A writer keeps one connection of the client's pool for itself (taken at its first
write, given back only when it is lost), so that a write costs no pool bookkeeping.
One Redis only (behind Sentinel too): a Cluster's and a ``wait_replicas`` writer's
writes go their usual ways.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from kombu_envelope.settings import Settings
from kombu_envelope.store.outages import is_outage
from kombu_envelope.store.packing import (
    first_error,
    pack_commands,
    read_replies,
    transaction_commands,
)

__all__ = ["MAX_UNREAD", "WriteBehind"]

#: Writes sent whose replies are not read yet, at most: a send reads theirs first.
MAX_UNREAD = 4


class WriteBehind:
    """Transactions sent on a connection of ``client``'s pool it keeps, replies read later.

    Safe to share between threads: a send or a settle waits for another one, and for
    the redos it makes (so a settle returns once a write lost by another thread's read
    was written again).
    """

    @classmethod
    def where_allowed(cls, client: Any, settings: Settings) -> WriteBehind | None:
        """A writer for ``client``, or None where writes must wait for their replies (a
        Cluster, ``wait_replicas``)."""
        if settings.wait_replicas or isinstance(client, RedisCluster):
            return None
        return cls(client)

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._connection: Any = None
        #: Per write sent and not read yet: how many replies, its redo, its failed and
        #: its landed.
        self._pending: list[tuple[int, Callable[[], None], Callable[[BaseException], None],
                                  Callable[[list[Any]], None] | None]] = []

    def send(self, pipe: Any, redo: Callable[[], None],
             failed: Callable[[BaseException], None],
             landed: Callable[[list[Any]], None] | None = None) -> None:
        """Send the commands queued on ``pipe`` (a redis-py pipeline, not executed) as one
        ``MULTI`` without waiting. ``redo()`` writes them the usual way when they cannot
        be sent or their reply is lost; ``failed(error)`` gets an error reply;
        ``landed(replies)`` gets ``EXEC``'s replies, as Redis sent them, once read."""
        commands = transaction_commands(pipe)
        with self._lock:
            redos = self._settle() if len(self._pending) >= MAX_UNREAD else []
            if not redos:  # else this write follows the earlier ones' redos
                try:
                    if self._connection is None:
                        self._connection = self.client.connection_pool.get_connection()
                    self._connection.send_packed_command(
                        pack_commands(self._connection, commands), check_health=False)
                except (RedisError, OSError):  # written the usual way, which reports it,
                    redos = self._drop()  # after the writes still unread, written again
                else:
                    self._pending.append((len(commands), redo, failed, landed))
                    return
            for again in [*redos, redo]:
                again()

    def settle(self) -> None:
        """Read every reply pending: their writes landed, or were written again, when
        this returns."""
        if not self._pending:
            return
        with self._lock:
            for again in self._settle():
                again()

    def _settle(self) -> list[Callable[[], None]]:
        """Read the pending replies (lock held); return the redos of the writes whose
        reply was lost, in the order they were sent."""
        connection = self._connection
        if connection is None:
            return []
        while self._pending:
            count, redo, failed, landed = self._pending[0]
            try:
                replies = read_replies(connection, count)
            except (RedisError, OSError):  # the connection is lost, or out of step
                return self._drop()
            self._pending.pop(0)
            error = first_error(replies)
            if error is not None:
                if is_outage(error):  # a demoted primary refused it: nothing ran
                    return [redo, *self._drop()]
                failed(error)
            elif landed is not None:
                landed(replies[-1])
        return []

    def _drop(self) -> list[Callable[[], None]]:
        """Disconnect after a lost connection; the redos of every write still pending."""
        redos = [redo for _, redo, _, _ in self._pending]
        self._pending.clear()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()
            self.client.connection_pool.release(connection)
        return redos
