"""The blocking read of one queue, on a connection of its own.

A consumer of several queues keeps one blocking read per queue (docs/protocol.md,
section 5, "Reading"): each queue is its own Cluster slot, so one ``XREADGROUP``
never spans two. Each :class:`QueueReader` owns a connection to the node that
serves its queue's slot; the transport's poller waits on all of their sockets
at once, on kombu's hub or in ``drain_events``.

A reader whose node stopped serving the slot (a resharding, a failover), whose
connection broke or timed out, or that was answered ``UNBLOCKED`` or a failover
reply is dropped and connects again when it is next armed: to the slot's new
owner on a Cluster, to the primary the sentinels name behind Sentinel.
"""

from __future__ import annotations

from typing import Any

from redis.connection import Connection

from kombu_envelope.store.cluster import connection_for

__all__ = ["QueueReader"]


class QueueReader:
    """One queue's blocking read: its connection, and the read in flight."""

    def __init__(self, queue: str, streams: tuple[str, ...]) -> None:
        self.queue = queue
        self.streams = streams
        self.connection: Connection | None = None
        #: Whether a read was sent and its reply not read yet.
        self.reading = False
        #: Whether the read in flight only waits for entries (XREAD) and takes none.
        self.wait_only = False
        #: The most entries the read in flight may take (its COUNT times its streams).
        self.reserved = 0
        #: Whether the last read's reply was lost with its connection (a failover, a
        #: restart): it may have taken entries, which the channel recovers before the
        #: next read (docs/protocol.md, section 5, outages).
        self.reply_lost = False

    def send(self, client: Any, *command: Any, reserved: int, wait_only: bool) -> int | None:
        """Send a blocking read (connecting first if needed); return its socket's fd."""
        if self.connection is None:
            self.connection = connection_for(client, self.streams[0])
        self.connection.send_command(*command)
        self.reading, self.reserved, self.wait_only = True, reserved, wait_only
        return self.fileno()

    def fileno(self) -> int | None:
        """The fd to wait on while a read is in flight."""
        sock = self.connection._sock if self.connection is not None else None
        return sock.fileno() if sock is not None and self.reading else None

    def reply(self) -> Any:
        """The reply of the read in flight (raises what Redis or the socket raised)."""
        self.reading, self.reserved = False, 0
        assert self.connection is not None
        return self.connection.read_response()

    def drop(self) -> None:
        """Close the connection; the next :meth:`send` opens a new one."""
        if self.connection is not None:
            self.connection.disconnect()
            self.connection = None
        self.reading, self.reserved = False, 0
