"""Independent steps sent in one round trip per node, on one Redis and on a Cluster.

A :class:`Batch` is a non-transactional pipeline that also carries script calls.
Nothing in it is atomic with anything else: each step is one command or one
script call, each on the keys of one queue (or one key without a hash tag), so
the same batch runs on a Cluster, where redis-py splits it per node.

redis-py's cluster pipelines refuse ``EVALSHA`` (and its scripts, which would
call it), and its plain pipelines send ``SCRIPT EXISTS`` before every batch that
carries a script: a second round trip. A batch sends ``EVALSHA`` as a raw
command instead, on a Cluster addressed to the node of its first key (redis-py
would otherwise ask the node for the keys of every call, ``COMMAND GETKEYS``).
On one Redis the batch writes its steps on a connection of the client's pool
itself, with the client's retry on a lost connection as a pipeline has, and reads
each reply with the client's parser: a ``publish_many`` of 1,000 spends a third of
its CPU in redis-py's pipeline layers otherwise (packing each call's arguments once
more, per-command bookkeeping). There, :meth:`Batch.flush` writes the steps queued so
far, so that Redis runs them while the caller builds the rest. A
call answered ``NOSCRIPT`` (a node that never saw the script, or lost it in a
restart or a failover) did nothing, so the script is loaded (``SCRIPT LOAD``
reaches every primary of a Cluster) and that call alone is sent again, after the
others. Callers put a step that must follow a script in a later
batch, never behind it in the same one.

A step that must land before the others (a registry's ``SADD``, docs/protocol.md,
section 2) is queued with :meth:`first`. One Redis runs a pipeline in order, so it
goes first in the same round trip; a Cluster pipeline writes to every node before
reading any reply, in no order across nodes, so there it is sent on its own first.

With ``wait_replicas`` (:mod:`kombu_envelope.store.replication`) a batch ends with
``WAIT`` on the connection that wrote: on one Redis (and behind Sentinel) one ``WAIT``
at the end of the pipeline, on a Cluster one per node the batch wrote to, addressed
to that node, which redis-py sends last on that node's connection. A call sent again
after ``NOSCRIPT`` goes in a second batch with its own ``WAIT``. What a Cluster
batch does not wait for, and why: the :meth:`first` steps (registry ``SADD``\\ s sent
on their own, whose connection is gone when they answer; a registry lost in a
failover is rebuilt by the next store, section 2), and a step redis-py's Cluster
pipeline sent again on its own after ``MOVED``, ``ASK`` or a lost connection (it
goes through the client's pool, not the connection the ``WAIT`` follows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - the hiredis extra is optional
    _hiredis_pack = None

from kombu_envelope.settings import Settings
from kombu_envelope.store.scripts import script, script_source

__all__ = ["Batch"]

#: The options of every step on one Redis (read, never changed).
_NO_OPTIONS: dict[str, Any] = {}


class Batch:
    """Commands and script calls for one round trip; :meth:`execute` answers in order.

    ``settings`` with ``wait_replicas`` make the batch end with ``WAIT`` (module
    docstring); ``step`` names the write in the log of a short ``WAIT``.
    """

    def __init__(self, client: Any, settings: Settings | None = None,
                 step: str = "write") -> None:
        self.client = client
        self.settings = settings
        self.step = step
        self._cluster = isinstance(client, RedisCluster)
        self._pipeline: Any = None
        self._steps: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        #: The script calls by step: on one Redis only the script's name (the keys and
        #: arguments are in the step's command), on a Cluster ``(name, keys, args)``.
        self._calls: dict[int, str | tuple[str, list[Any], list[Any]]] = {}
        self._shas: dict[str, str] = {}  # by script name: looked up once per batch
        self._size = 0
        #: Commands a Cluster gets before the pipeline; on one Redis, how many of the
        #: pipeline's first commands are first() steps.
        self._first: list[tuple[str, tuple[Any, ...]]] = []
        self._first_in_pipe = 0
        #: On a Cluster, the nodes the batch writes to (by name): each gets a WAIT.
        self._nodes: dict[str, Any] = {}
        #: On one Redis, the connection :meth:`flush` wrote the first ``_written`` steps on.
        self._connection: Any = None
        self._written = 0

    @property
    def _pipe(self) -> Any:
        """On a Cluster, redis-py's pipeline; on one Redis, only what builds a command's
        arguments (made when a command needs it), the steps themselves being sent by
        :meth:`execute`."""
        if self._pipeline is None:
            self._pipeline = self.client.pipeline(transaction=False)
        return self._pipeline

    @property
    def _wait(self) -> int:
        return self.settings.wait_replicas if self.settings is not None else 0

    def first(self, name: str, *args: Any) -> Batch:
        """Queue a command that lands before every other step (call it before them);
        its reply is not among those :meth:`execute` returns."""
        if self._size > self._first_in_pipe:
            raise RuntimeError("Batch.first() after other steps")
        if self._cluster:
            self._first.append((name, args))
        else:
            self.command(name, *args)
            self._first_in_pipe += 1
        return self

    def command(self, name: str, *args: Any) -> Batch:
        """Queue one command (any the pipeline has, e.g. ``"xack"``) whose first
        argument is its key."""
        getattr(self._pipe, name)(*args)
        if not self._cluster:
            self._steps.append(self._pipe.command_stack.pop())
        elif self._wait and args:
            node = self.client.get_node_from_key(args[0])
            self._nodes[node.name] = node
        self._size += 1
        return self

    def script(self, name: str, keys: list[Any], args: list[Any]) -> Batch:
        """Queue a call of script ``name`` (``kombu_envelope/lua/<name>.lua``)."""
        sha = self._shas.get(name)
        if sha is None:
            sha = self._shas[name] = script(self.client, name).sha
        if self._cluster:
            options = {}
            if keys:
                # Named here, the node is not asked (COMMAND GETKEYS, a round trip per
                # call) which keys the call has; a MOVED reply routes it again by its keys.
                node = self.client.get_node_from_key(keys[0])
                options["target_nodes"] = node
                self._nodes[node.name] = node
            self._pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args, **options)
            self._calls[self._size] = (name, keys, args)
        else:
            # Nothing more per step than its command: a batch of 1,000 holds them until
            # it is read, long enough for the GC to walk each container it keeps.
            self._steps.append((("EVALSHA", sha, len(keys), *keys, *args), _NO_OPTIONS))
            self._calls[self._size] = name
        self._size += 1
        return self

    def _call(self, index: int) -> tuple[str, list[Any], list[Any]]:
        """``(name, keys, args)`` of the script call at step ``index``."""
        call = self._calls[index]
        if not isinstance(call, str):
            return call
        command = self._steps[index][0]
        count = command[2]
        return call, list(command[3:3 + count]), list(command[3 + count:])

    def flush(self) -> None:
        """Write the steps queued so far, on one Redis, so that it runs them while the
        caller queues the rest; :meth:`execute` writes the others on the same connection
        and reads every reply. A Cluster batch is sent by :meth:`execute` alone. A
        connection lost here is noticed there, which writes every step again on a new
        one (the client's retry, as for a batch sent at once). Call :meth:`close` if
        :meth:`execute` may not follow."""
        if self._cluster or self._written == len(self._steps):
            return
        try:
            if self._connection is None:
                self._connection = self.client.connection_pool.get_connection()
            self._write(self._connection, self._written)
            self._written = len(self._steps)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            self._written = 0  # disconnected by redis-py: execute() writes all again

    def close(self) -> None:
        """Give back a connection :meth:`flush` wrote on and :meth:`execute` did not read
        (disconnected: its replies are never read)."""
        if self._connection is not None:
            self._connection.disconnect()
            self.client.connection_pool.release(self._connection)
            self._connection = None

    def execute(self) -> list[Any]:
        """Send everything; return the reply of each step but :meth:`first`'s, in order
        (raises the first error)."""
        from kombu_envelope.store.replication import acknowledged_by

        for name, first_args in self._first:
            getattr(self.client, name)(*first_args)
        waits = 0
        if self._wait and self._size:
            assert self.settings is not None
            wait = ("WAIT", self.settings.wait_replicas, self.settings.wait_timeout_ms)
            if self._cluster:
                for node in self._nodes.values():
                    self._pipe.execute_command(*wait, target_nodes=node)
                    waits += 1
            else:
                self._steps.append((wait, {}))
                waits = 1
        replies: list[Any] = (list(self._pipe.execute(raise_on_error=False)) if self._cluster
                              else self._send())
        wait_replies = replies[len(replies) - waits:] if waits else []
        replies = replies[:len(replies) - waits]
        for reply in wait_replies:
            if isinstance(reply, Exception):
                raise reply  # the WAIT's connection broke: the step is retried as an outage
            assert self.settings is not None
            acknowledged_by(_replicas(reply), self.settings, self.step)
        missing = [index for index in self._calls if isinstance(replies[index], NoScriptError)]
        if missing:
            if self._wait:
                # Sent again in a batch of their own, so that a WAIT follows them too.
                for name in {self._call(index)[0] for index in missing}:
                    self.client.script_load(script_source(name))
                again = Batch(self.client, self.settings, self.step)
                for index in missing:
                    again.script(*self._call(index))
                for index, reply in zip(missing, again.execute()):
                    replies[index] = reply
            else:
                for index in missing:
                    name, keys, args = self._call(index)
                    replies[index] = script(self.client, name)(keys=keys, args=args)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies[self._first_in_pipe:]

    def _send(self) -> list[Any]:
        """Write the steps on one connection of the pool and read a reply (or the
        ``ResponseError``) for each; a lost connection is tried again as the client's
        retry says, as redis-py's pipelines do."""
        if not self._steps:
            return []
        pool = self.client.connection_pool
        connection, self._connection = self._connection or pool.get_connection(), None
        try:
            return list(connection.retry.call_with_retry(
                lambda: self._exchange(connection), lambda _error: connection.disconnect()))
        finally:
            pool.release(connection)

    def _write(self, connection: Any, start: int) -> None:
        """Write the steps from ``start`` on, packed and joined (:func:`_chunks`)."""
        connection.send_packed_command(_chunks(
            piece for args, _ in self._steps[start:] for piece in _packed(connection, args)))

    def _exchange(self, connection: Any) -> list[Any]:
        written, self._written = self._written, 0  # a try again writes every step
        self._write(connection, written)
        replies: list[Any] = []
        for args, options in self._steps:
            try:
                replies.append(self.client.parse_response(connection, args[0], **options))
            except ResponseError as exc:
                replies.append(exc)
        return replies


#: Pieces of a batch are joined up to this size, so that its many small commands are
#: written in a few calls while a large body is not copied once more.
_CHUNK_BYTES = 64 * 1024


def _chunks(pieces: Iterator[bytes]) -> list[bytes]:
    chunks: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for piece in pieces:
        if len(piece) >= _CHUNK_BYTES:
            if pending:
                chunks.append(b"".join(pending))
                pending, size = [], 0
            chunks.append(piece)
            continue
        pending.append(piece)
        size += len(piece)
        if size >= _CHUNK_BYTES:
            chunks.append(b"".join(pending))
            pending, size = [], 0
    if pending:
        chunks.append(b"".join(pending))
    return chunks


def _packed(connection: Any, args: tuple[Any, ...]) -> list[bytes]:
    """One command in the wire protocol: a script call's arguments (text, bytes and
    numbers) straight through hiredis, as redis-py itself does when it is installed."""
    if _hiredis_pack is not None and args[0] == "EVALSHA":
        try:
            return [_hiredis_pack(args)]
        except TypeError:  # e.g. a memoryview: redis-py converts it, or names the error
            pass
    return list(connection.pack_command(*args))


def _replicas(reply: Any) -> int:
    """The replica count of a ``WAIT`` reply (a Cluster client that sent it to every
    primary answers a mapping or list: the fewest counts)."""
    if isinstance(reply, dict):
        return min(int(value) for value in reply.values())
    if isinstance(reply, list):
        return min(int(value) for value in reply)
    return int(reply)
