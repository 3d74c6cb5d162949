"""Independent steps sent in one round trip per node, on one Redis and on a Cluster.

A :class:`Batch` is a non-transactional pipeline that also carries script calls.
Nothing in it is atomic with anything else: each step is one command or one
script call, each on the keys of one queue (or one key without a hash tag), so
the same batch runs on a Cluster, where redis-py splits it per node.

redis-py's cluster pipelines refuse ``EVALSHA`` (and its scripts, which would
call it), and its plain pipelines send ``SCRIPT EXISTS`` before every batch that
carries a script: a second round trip. A batch sends ``EVALSHA`` as a raw
command instead, on a Cluster addressed to the node of its first key (redis-py
would otherwise ask the node for the keys of every call, ``COMMAND GETKEYS``). A
call answered ``NOSCRIPT`` (a node that never saw the script, or lost it in a
restart or a failover) did nothing, so the script is loaded (``SCRIPT LOAD``
reaches every primary of a Cluster) and that call alone is sent again, after the
others. Callers put a step that must follow a script in a later
batch, never behind it in the same one.

A step that must land before the others (a registry's ``SADD``, docs/protocol.md,
section 2) is queued with :meth:`first`. One Redis runs a pipeline in order, so it
goes first in the same round trip; a Cluster pipeline writes to every node before
reading any reply, in no order across nodes, so there it is sent on its own first.
"""

from __future__ import annotations

from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from kombu_envelope.store.scripts import script

__all__ = ["Batch"]


class Batch:
    """Commands and script calls for one round trip; :meth:`execute` answers in order."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pipe = client.pipeline(transaction=False)
        self._calls: dict[int, tuple[str, list[Any], list[Any]]] = {}
        self._size = 0
        #: Commands a Cluster gets before the pipeline; on one Redis, how many of the
        #: pipeline's first commands are first() steps.
        self._first: list[tuple[str, tuple[Any, ...]]] = []
        self._first_in_pipe = 0

    def first(self, name: str, *args: Any) -> Batch:
        """Queue a command that lands before every other step (call it before them);
        its reply is not among those :meth:`execute` returns."""
        if self._size > self._first_in_pipe:
            raise RuntimeError("Batch.first() after other steps")
        if isinstance(self.client, RedisCluster):
            self._first.append((name, args))
        else:
            self.command(name, *args)
            self._first_in_pipe += 1
        return self

    def command(self, name: str, *args: Any) -> Batch:
        """Queue one command (any the pipeline has, e.g. ``"xack"``)."""
        getattr(self._pipe, name)(*args)
        self._size += 1
        return self

    def script(self, name: str, keys: list[Any], args: list[Any]) -> Batch:
        """Queue a call of script ``name`` (``kombu_envelope/lua/<name>.lua``)."""
        sha = script(self.client, name).sha
        options = {}
        if isinstance(self.client, RedisCluster) and keys:
            # Named here, the node is not asked (COMMAND GETKEYS, a round trip per call)
            # which keys the call has; a MOVED reply routes it again by its keys.
            options["target_nodes"] = self.client.get_node_from_key(keys[0])
        self._pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args, **options)
        self._calls[self._size] = (name, keys, args)
        self._size += 1
        return self

    def execute(self) -> list[Any]:
        """Send everything; return the reply of each step but :meth:`first`'s, in order
        (raises the first error)."""
        for name, first_args in self._first:
            getattr(self.client, name)(*first_args)
        replies: list[Any] = list(self._pipe.execute(raise_on_error=False))
        for index, (name, keys, args) in self._calls.items():
            if isinstance(replies[index], NoScriptError):
                replies[index] = script(self.client, name)(keys=keys, args=args)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies[self._first_in_pipe:]
