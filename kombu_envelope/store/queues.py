"""The Redis keys of a queue: declared, counted, purged and deleted.

A queue is its priority streams and its ``kombu`` stream, each read by the
shared consumer group, plus its delayed set and a meta HASH. The meta HASH
says whether the queue is transient (``auto_delete``, or declared with an
expiry): the kombu messages of a transient queue are capped at
``transient_maxlen``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from redis.exceptions import ResponseError

from kombu_envelope.keys import QueueKeys
from kombu_envelope.settings import Settings
from kombu_envelope.store.scripts import script

_TRANSIENT_ARGUMENTS = ("x-expires", "x-message-ttl")


class Queues:
    """Declares, counts, purges and deletes queues; remembers which are transient."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.keys = settings.keys
        self._transient: dict[str, bool] = {}

    def declare(self, queue: str, auto_delete: bool = False,
                arguments: Mapping[str, Any] | None = None) -> None:
        """Create the consumer group on every stream of ``queue`` (kept when it exists)."""
        keys = self.keys.queue(queue)
        pipe = self.client.pipeline(transaction=False)
        for stream in keys.all_streams:
            pipe.xgroup_create(stream, self.settings.consumer_group, id="0", mkstream=True)
        arguments = arguments or {}
        transient = auto_delete or any(a in arguments for a in _TRANSIENT_ARGUMENTS)
        if transient:
            pipe.hset(keys.meta, "transient", 1)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, ResponseError) and not str(reply).startswith("BUSYGROUP"):
                raise reply
        self._transient[queue] = transient or self._transient.get(queue, False)

    def is_transient(self, queue: str) -> bool:
        """Whether ``queue`` was declared transient, by any process."""
        known = self._transient.get(queue)
        if known is None:
            known = self._transient[queue] = bool(
                self.client.hget(self.keys.queue(queue).meta, "transient")
            )
        return known

    def exists(self, queue: str) -> bool:
        """Whether any stream of ``queue`` exists."""
        return bool(self.client.exists(*self.keys.queue(queue).all_streams))

    def size(self, queue: str) -> int:
        """Entries waiting to be read (neither delivered nor delayed)."""
        keys = self.keys.queue(queue)
        pipe = self.client.pipeline(transaction=False)
        for stream in keys.all_streams:
            pipe.xlen(stream)
            pipe.xpending(stream, self.settings.consumer_group)
        replies = pipe.execute(raise_on_error=False)
        size = 0
        for length, pending in zip(replies[::2], replies[1::2]):
            if isinstance(length, int):
                size += length - (pending["pending"] if isinstance(pending, dict) else 0)
        return size

    def purge(self, queue: str) -> int:
        """Delete entries nobody has read yet, delayed tasks and keyed tasks waiting for
        their turn; return how many."""
        keys = self.keys.queue(queue)
        purger = f"purge-{uuid.uuid4().hex[:8]}"
        read = script(self.client, "read")
        purged = 0
        while True:
            reply = read(keys=list(keys.all_streams),
                         args=[self.settings.consumer_group, purger, 1000])
            if not reply:
                break
            pipe = self.client.pipeline(transaction=True)
            for stream, entries in reply:
                ids = [entry_id for entry_id, _ in entries]
                pipe.xack(stream, self.settings.consumer_group, *ids)
                pipe.xdel(stream, *ids)
                purged += len(ids)
            pipe.execute()
        pipe = self.client.pipeline(transaction=True)
        pipe.zcard(keys.delayed)
        pipe.delete(keys.delayed, keys.delayed_data)
        for stream in keys.all_streams:
            pipe.xgroup_delconsumer(stream, self.settings.consumer_group, purger)
        delayed: int = pipe.execute(raise_on_error=False)[0]
        return purged + delayed + self._purge_waiting(keys)

    def _purge_waiting(self, keys: QueueKeys) -> int:
        """Delete the keyed tasks waiting for their turn, and the orders of their keys
        (docs/protocol.md, section 20); return how many tasks."""
        purged = 0
        for name in self.client.scan_iter(match=keys.order_waiting("*"), count=500):
            pipe = self.client.pipeline(transaction=True)
            pipe.hlen(name)
            pipe.delete(name)
            purged += pipe.execute()[0]
        for name in self.client.scan_iter(match=keys.order("*"), count=500):
            self.client.delete(name)
        return purged

    def delete(self, queue: str) -> None:
        """Delete every key of ``queue``."""
        keys = self.keys.queue(queue)
        self.client.delete(*keys.all_streams, keys.delayed, keys.delayed_data, keys.meta)
        self._transient.pop(queue, None)
