"""What differs between the two brokers under drill: URL, options, dead letters, leftovers.

* ``envelope://`` gets the drill's ``lease_ms``; its dead-letter stream is read back.
* Celery's stock ``redis://`` has no lease: its analogue is ``visibility_timeout``, the
  time after which a message delivered and never acknowledged is delivered again. It
  must exceed the longest countdown, since the stock transport keeps a countdown task
  unacknowledged in the worker that holds it; its restore sweep is made to run every
  second (default: about every 100 s). It has no dead-letter stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.drill.app import QUEUE
from bench.drill.config import ENVELOPE, DrillConfig
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.replies import as_text
from kombu_envelope.testing.sentinel import SentinelGroup


@dataclass(frozen=True)
class DeadLetterRecord:
    """One task the broker dead-lettered."""

    task_id: str | None
    failure_class: str
    reason: str


@dataclass(frozen=True)
class Broker:
    """The broker a drill runs on: its URL (one Redis, a Sentinel group or a Cluster)."""

    kind: str
    #: The broker URL of the drill's apps.
    url: str
    prefix: str
    queues: tuple[str, ...] = (QUEUE,)
    #: The Sentinel group behind the broker, if any (``url`` is then the group's).
    sentinel: SentinelGroup | None = None

    @property
    def label(self) -> str:
        """``envelope://``, ``envelope-sentinel://``, ``envelope-cluster://`` or
        ``redis:// (stock)``."""
        if self.kind != ENVELOPE:
            return "redis:// (stock)"
        return self.url.split("//", 1)[0] + "//"

    def transport_options(self, config: DrillConfig) -> dict[str, Any]:
        """``broker_transport_options`` of the drill's apps."""
        if self.kind == ENVELOPE:
            options: dict[str, Any] = {"key_prefix": self.prefix, "lease_ms": config.lease_ms,
                                       "wait_replicas": config.wait_replicas}
            if self.sentinel is not None:
                options.update(self.sentinel.transport_options(),
                               socket_timeout=config.socket_timeout_s)
            return options
        return {"global_keyprefix": f"{self.prefix}:",
                "visibility_timeout": config.visibility_timeout_s,
                "unacked_restore_interval": 1, "unacked_restore_throttle": 1}

    def dead_letters(self, client: Any) -> list[DeadLetterRecord]:
        """Every task the broker dead-lettered (none on stock redis://: it cannot)."""
        if self.kind != ENVELOPE:
            return []
        letters = DeadLetters(client, Settings(key_prefix=self.prefix))
        return [DeadLetterRecord(entry.task_id, entry.failure_class,
                                 entry.fields.get("reason", ""))
                for queue in self.queues for entry in letters.iter(queue)]

    def leftovers(self, client: Any) -> dict[str, int]:
        """What the broker still holds of the drill's queue: waiting, pending, delayed."""
        if self.kind != ENVELOPE:
            names = [as_text(k) for k in client.scan_iter(match=f"{self.prefix}:{QUEUE}*")]
            found = {name: int(client.llen(name)) for name in names
                     if as_text(client.type(name)) == "list"}
            found["unacked"] = int(client.hlen(f"{self.prefix}:unacked"))
            return found
        settings = Settings(key_prefix=self.prefix)
        found = {}
        for queue in self.queues:
            keys = settings.keys.queue(queue)
            for stream in keys.task_streams:
                found[f"{stream} entries"] = int(client.xlen(stream))
                if found[f"{stream} entries"]:
                    found[f"{stream} pending"] = int(client.xpending(
                        stream, settings.consumer_group)["pending"])
            found[f"{keys.delayed}"] = int(client.zcard(keys.delayed))
        return found
