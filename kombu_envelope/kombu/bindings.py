"""Exchange bindings, stored in Redis so that routing agrees across processes.

Each exchange has a SET of members ``routing_key, pattern, queue`` joined by
:data:`BINDING_SEP`. A channel keeps a direct exchange's table for
``binding_cache_ms`` and forgets it whenever it binds or unbinds; topic and
fanout tables (events, broadcasts), where a binding made a moment ago by
another process must get the next message, are read on every publish.
"""

from __future__ import annotations

from time import monotonic
from typing import Any

from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

#: Separator of the members of an exchange's binding set.
BINDING_SEP = "\x06"

#: One binding: (routing_key, pattern, queue).
Binding = tuple[str, str, str]


def _member(routing_key: str, pattern: str | None, queue: str) -> str:
    """The member of an exchange's binding set that stands for one binding."""
    return BINDING_SEP.join((routing_key or "", pattern or "", queue))


class Bindings:
    """The binding tables of every exchange, shared through Redis and cached briefly."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        #: exchange -> (read at, bindings); see table.
        self._tables: dict[str, tuple[float, list[Binding]]] = {}

    def add(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        """Bind ``queue`` to ``exchange``."""
        self._tables.pop(exchange, None)
        self.client.sadd(self.settings.keys.binding(exchange),
                         _member(routing_key, pattern, queue))

    def remove(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        """Unbind ``queue`` from ``exchange``."""
        self._tables.pop(exchange, None)
        self.client.srem(self.settings.keys.binding(exchange),
                         _member(routing_key, pattern, queue))

    def table(self, exchange: str, cached_ok: bool = True) -> list[Binding]:
        """Bindings of ``exchange``, read again at most every ``binding_cache_ms``
        (always when not ``cached_ok``)."""
        cached = self._tables.get(exchange)
        now = monotonic()
        if (cached_ok and cached is not None
                and now - cached[0] < self.settings.binding_cache_ms / 1000):
            return cached[1]
        table = []
        for member in self.client.smembers(self.settings.keys.binding(exchange)):
            routing_key, pattern, queue = as_text(member).split(BINDING_SEP)
            table.append((routing_key, pattern, queue))
        self._tables[exchange] = (now, table)
        return table

    def forget(self, exchange: str) -> bool:
        """Drop the cached table of ``exchange``; return whether one was cached."""
        return self._tables.pop(exchange, None) is not None
