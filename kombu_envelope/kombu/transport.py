"""kombu transport ``envelope://`` on Redis Streams (``envelopes://`` for TLS; Sentinel too).

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings are shared through Redis)
* Supports Priority: Yes for tasks (0-255, higher first; three buckets per queue);
  other kombu messages are delivered in publish order
* Supports TTL: No

Connection String
=================
``envelope://[USER:PASSWORD@]HOST[:PORT][/DB]``, ``envelopes://...`` for TLS.
A Sentinel group: ``envelope-sentinel://[USER:PASSWORD@]HOST[:26379][/DB];envelope-sentinel://HOST2...``
with the ``master_name`` option (``envelopes-sentinel://`` for TLS). A Redis Cluster:
``envelope-cluster://[USER:PASSWORD@]HOST[:PORT];envelope-cluster://HOST2...`` (seed
nodes; ``envelopes-cluster://`` for TLS). See
:mod:`kombu_envelope.store.client` for every form.

Transport Options
=================
Fields of :class:`kombu_envelope.settings.Settings` (docs/operations.md has their
defaults and units): ``key_prefix``, ``consumer_group``, ``lease_ms``, ``block_ms``,
``max_batch``, ``binding_cache_ms``, ``cancel_check_ms``, ``schema_cache_s``,
``gzip_min_bytes``, ``max_delay_s``, ``max_payload_depth``, ``max_payload_bytes``,
``transient_maxlen``, ``max_redeliveries``, ``message_adapter``, ``outage_tolerance_s``,
``wait_replicas`` and ``wait_timeout_ms`` (WAIT after publishing and settling),
``task_record_retention_s`` (task records) and ``announce_keep_s`` (worker announcements),
``connection_kwargs``,
the Sentinel options ``master_name``, ``sentinel_kwargs`` and ``min_other_sentinels``,
and the redis-py connection options named and meant as on kombu's ``redis://``: ``socket_timeout``,
``socket_connect_timeout``, ``socket_keepalive``, ``socket_keepalive_options``,
``retry_on_timeout``, ``health_check_interval``, ``client_name``, ``max_connections``.

Any other key raises :class:`~kombu_envelope.errors.InvalidTransportOption` naming it,
as does a value of the wrong type, except the keys kombu reads itself
(:data:`~kombu_envelope.settings.KOMBU_OPTIONS`: a publish's retry policy,
``body_encoding``, ``deadletter_queue``...). The other options of ``redis://`` are
refused with what to use instead (:data:`~kombu_envelope.settings.STOCK_REDIS_OPTIONS`):
``visibility_timeout`` is not needed, as a live worker's lease keeps its tasks however
long they run and ``lease_ms`` is how soon a dead worker's are taken over;
``global_keyprefix`` is ``key_prefix``; ``ack_emulation``, ``unacked_*``,
``priority_steps``, ``queue_order_strategy``, ``sep``, ``fanout_prefix``,
``fanout_patterns``, ``polling_interval``, ``reauth_check_interval`` and
``sentinel_fanout_compat`` have no use here.

Celery
======
Celery apps must import ``celery_ext`` (the ``celery`` command line does): this
transport raises :class:`~kombu_envelope.errors.CeleryExtensionMissing` when Celery is
loaded without it, and its default adapter refuses Celery task messages, rather than
store them where no other language reads them. Celery is looked for, never imported.
"""

from __future__ import annotations

import select
import socket
import sys
import time
from time import monotonic
from typing import Any

import redis
from kombu.transport import virtual
from kombu.transport.redis import get_redis_error_classes
from kombu.utils.imports import symbol_by_name
from kombu.utils.objects import cached_property
from redis.exceptions import RedisClusterException

from kombu_envelope.errors import CELERY_FIX, CeleryExtensionMissing
from kombu_envelope.kombu.adapter import MessageAdapter
from kombu_envelope.kombu.channel import Channel
from kombu_envelope.kombu.readers import QueueReader
from kombu_envelope.outbox.context import OutboxSink, current_sink
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import AnyRedis, RedisEndpoint, close_client, new_client
from kombu_envelope.store.cluster import CLUSTER_REDIRECTS
from kombu_envelope.store.lease import LeaseKeeper, process_keeper
from kombu_envelope.store.outages import OUTAGE_ERRORS

#: Pause before a Cluster reader that lost its node tries again (seconds): a failover
#: takes seconds, and the event loop must not spin meanwhile.
RETRY_READ_S = 0.1


class Poller:
    """Tracks the channels of one connection and their blocking-read sockets.

    Messages a read brought beyond the first wait in their channel's buffer; while
    any does, :meth:`arm` also returns the fd of a socket that is always readable,
    so that the event loop comes back at once to deliver the next one.
    """

    def __init__(self) -> None:
        self.channels: list[Channel] = []
        self._fd_to_reader: dict[int, tuple[Channel, QueueReader]] = {}
        self._always_readable: tuple[socket.socket, socket.socket] | None = None
        #: Whether channels batch their acks until the next arm().
        self.defer_acks = False

    def add(self, channel: Channel) -> None:
        """Poll ``channel`` from now on."""
        channel.settler.defer_acks = self.defer_acks
        self.channels.append(channel)

    def use_event_loop(self) -> None:
        """An event loop drives the channels: batch their acks per turn (see arm)."""
        self.defer_acks = True
        for channel in self.channels:
            channel.settler.defer_acks = True

    def discard(self, channel: Channel) -> None:
        """Stop polling ``channel``."""
        if channel in self.channels:
            self.channels.remove(channel)
        for fd, (known, _reader) in list(self._fd_to_reader.items()):
            if known is channel:
                del self._fd_to_reader[fd]

    def arm(self) -> list[int]:
        """Settle pending acks, then start a blocking read on every queue of every
        channel that can consume (one per queue); return the fds to wait on.

        A channel that still has a message to deliver keeps its acks for the next
        turns (one ``MULTI`` for the messages of one read), unless the oldest has
        waited ``ACK_BATCH_S``; acks always go before the loop waits. They are sent
        without waiting, and their replies read once the reads started (Redis has run
        the acks by then, so reading costs no wait).
        """
        self._fd_to_reader = {}
        come_back = False
        for channel in list(self.channels):
            if not channel.has_buffered() or channel.settler.acks_waited():
                channel.settler.flush_acks(wait=False)
            if not channel.has_buffered():
                for fd, reader in channel.start_blocking_reads():
                    self._fd_to_reader[fd] = (channel, reader)
                # Read while Redis ran the reads above, or while the loop waits otherwise.
                channel.settler.settle_acks()
            if channel.retry_reads_soon:  # a Cluster reader lost its node: try again soon
                channel.retry_reads_soon = False
                time.sleep(RETRY_READ_S)
                come_back = True
            come_back = come_back or channel.has_buffered()
        fds = list(self._fd_to_reader)
        if come_back:
            fds.append(self._ready_fd())
        return fds

    def _ready_fd(self) -> int:
        if self._always_readable is None:
            self._always_readable = socket.socketpair()
            self._always_readable[1].send(b"\0")  # never read: the other end stays readable
        return self._always_readable[0].fileno()

    def close(self) -> None:
        """Close the always-readable socket pair (made again when needed)."""
        if self._always_readable is not None:
            for sock in self._always_readable:
                sock.close()
            self._always_readable = None

    def on_readable(self, fd: int) -> int:
        """A read reply arrived on ``fd``: deliver it; return messages delivered."""
        if self._always_readable is not None and fd == self._always_readable[0].fileno():
            return sum(channel.deliver_buffered() for channel in list(self.channels))
        found = self._fd_to_reader.get(fd)
        if found is None or not found[1].reading:
            return 0
        channel, reader = found
        return channel.finish_blocking_read(reader)


class Transport(virtual.Transport):
    """The ``envelope://`` transport."""

    Channel = Channel

    default_port = 6379  # type: ignore[assignment]  # kombu's base value is None
    driver_type = "redis"  # Celery enables gossip, mingle and events for "redis"
    driver_name = "redis"
    polling_interval = None  # type: ignore[assignment]  # no polling: reads block

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    #: kombu's Redis errors, plus the failover replies redis-py raises as response
    #: errors (``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN``) and a Cluster between two
    #: owners of a slot, or with none reachable: a lost connection to Celery and kombu
    #: (they reconnect), never a failure of the channel.
    connection_errors = (*get_redis_error_classes().connection_errors, *OUTAGE_ERRORS,
                         *CLUSTER_REDIRECTS, RedisClusterException)
    channel_errors = get_redis_error_classes().channel_errors

    #: Adapter used when the ``message_adapter`` option is not set.
    default_adapter = MessageAdapter

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.settings = Settings.from_transport_options(client.transport_options)
        self._refuse_celery_without_extension()
        self.poller = Poller()
        self._stream_queues: dict[str, str] = {}

    def _refuse_celery_without_extension(self) -> None:
        """Fail at once when a Celery app would use this transport without ``celery_ext``.

        Celery is looked for in ``sys.modules``, never imported: this package does not
        depend on it. Naming ``message_adapter`` says which adapter is meant, and skips this.
        """
        if (self.default_adapter is MessageAdapter and self.settings.message_adapter is None
                and "celery" in sys.modules and "celery_ext" not in sys.modules):
            raise CeleryExtensionMissing(
                "Celery is loaded but celery_ext is not: envelope:// would store Celery "
                "tasks as plain kombu messages that no other language reads, and workers "
                f"would run no delayed-task promoter; {CELERY_FIX}. A process that sends "
                "no Celery task over envelope:// may set the transport option "
                "message_adapter instead")

    def driver_version(self) -> str:
        return str(redis.__version__)

    @cached_property
    def adapter(self) -> MessageAdapter:
        """The message adapter named by the ``message_adapter`` option."""
        name = self.settings.message_adapter
        adapter_cls = symbol_by_name(name) if name else self.default_adapter
        adapter: MessageAdapter = adapter_cls()
        return adapter

    @cached_property
    def endpoint(self) -> RedisEndpoint:
        """Where Redis is, from this connection's URL and ``ssl`` argument."""
        return RedisEndpoint.from_conninfo(self.client)

    @cached_property
    def shared_client(self) -> AnyRedis:
        """The client whose connection pool (a Cluster: whose node pools) this
        connection's channels share."""
        return new_client(self.endpoint, self.settings)

    def new_redis_client(self) -> AnyRedis:
        """A client on the shared pool; on a Cluster, the shared client itself (it holds
        one pool per node and is closed with the connection)."""
        shared: AnyRedis = self.shared_client
        if isinstance(shared, redis.Redis):
            return redis.Redis(connection_pool=shared.connection_pool)
        return shared

    @cached_property
    def lease_keeper(self) -> LeaseKeeper:
        """Keeps this process's consumers alive, across reconnections (see LeaseKeeper)."""
        conninfo: Any = self.client
        settings, endpoint = self.settings, self.endpoint
        identity = (conninfo.as_uri(include_password=True), settings.key_prefix,
                    settings.consumer_group, settings.lease_ms)
        return process_keeper(identity, lambda: new_client(endpoint, settings), settings)

    def keeps_running(self, message: Any) -> bool:
        """Whether a delivered, unacknowledged ``message`` is still being run.

        When its channel closes (the connection broke, or was replaced), such a
        message is neither put back nor given up: its consumer stays alive until
        the message is settled. The base transport cannot know (False); Celery's
        (:class:`celery_ext.transport.Transport`) asks the worker.
        """
        return False

    def served_tasks(self) -> dict[str, list[int]]:
        """The task types this process's consumers run, with the payload versions each
        accepts (docs/protocol.md, section 15). The base transport runs none of its own
        (``{}``); Celery's names its worker's tasks."""
        return {}

    def concurrency(self) -> int | None:
        """How many tasks this process runs at once, when known (None here)."""
        return None

    def start_capacity(self) -> int | None:
        """How many more tasks this process could start now, when known (None here: as
        many as the prefetch credit). Entries of limited task types are read only up to
        it, so that none holds a slot while it waits (docs/protocol.md, section 19)."""
        return None

    def running_deliveries(self) -> list[dict[str, Any]]:
        """The delivery_info of every task this process runs or holds for running, also
        those acknowledged already (none here: a plain kombu consumer acks when done), so
        that their concurrency slots are renewed until the run ends."""
        return []

    def runner_frees_slots(self) -> bool:
        """Whether whoever runs a task frees its concurrency slot when the run ends (an
        execution shell does; it may run after an early acknowledgement), rather than
        the acknowledgement (False here: a plain kombu consumer acks when done)."""
        return False

    def outbox_sink(self) -> OutboxSink | None:
        """Where a task published now goes instead of Redis: the enclosing
        :func:`~kombu_envelope.outbox.context.divert_to`'s sink, if any (Celery's
        transport also follows the ``envelope_outbox`` setting)."""
        return current_sink()

    def queue_of_stream(self, stream: str) -> str:
        """The queue a stream key belongs to (the hash tag between the braces)."""
        queue = self._stream_queues.get(stream)
        if queue is None:
            queue = self._stream_queues[stream] = stream[stream.index("{") + 1:
                                                         stream.rindex("}")]
        return queue

    # --------------------------------------------------------- event loop

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        """Register blocking-read sockets with the hub on every tick."""
        poller = self.poller
        add_reader = loop.add_reader
        poller.use_event_loop()

        def on_readable(fd: int) -> None:
            loop.remove_reader(fd)  # armed again on the next tick
            poller.on_readable(fd)

        def on_poll_start() -> None:
            for fd in poller.arm():
                add_reader(fd, on_readable, fd)

        loop.on_tick.add(on_poll_start)

    def drain_events(  # type: ignore[override]  # as kombu's virtual.Transport
        self, connection: Any, timeout: float | None = None
    ) -> None:
        """Wait up to ``timeout`` seconds for messages and deliver them."""
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            fds = self.poller.arm()
            remaining = None if deadline is None else max(deadline - monotonic(), 0)
            if not fds:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError()
                select.select([], [], [], min(remaining if remaining is not None else 1, 1))
                continue
            readable, _, _ = select.select(fds, [], [], remaining)
            delivered = sum(self.poller.on_readable(fd) for fd in readable)
            if delivered:
                return
            if deadline is not None and monotonic() >= deadline:
                raise TimeoutError()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:  # also when a channel could not reach Redis while closing
            self.poller.close()
            if "shared_client" in self.__dict__:
                close_client(self.shared_client)
