"""Transport options: what they are called, their units and their defaults.

Celery users set them with ``broker_transport_options``; plain kombu users
pass ``transport_options`` to :class:`kombu.Connection`. Unknown keys are
ignored, like kombu's own transports do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from kombu_envelope.codec import DEFAULT_GZIP_MIN_BYTES
from kombu_envelope.envelope import Limits
from kombu_envelope.keys import DEFAULT_GROUP, DEFAULT_PREFIX, KeySpace


@dataclass(frozen=True)
class Settings:
    """Every transport option, with its unit in the name or the comment."""

    #: Prefix of every Redis key, so several apps can share one Redis.
    key_prefix: str = DEFAULT_PREFIX
    #: Consumer group that all workers of all languages join.
    consumer_group: str = DEFAULT_GROUP
    #: How long a consumer stays alive without renewing its liveness key (ms).
    #: Entries held by a consumer dead for this long go back to their stream.
    lease_ms: int = 30_000
    #: How long one blocking read waits for new entries (ms).
    block_ms: int = 1_000
    #: Largest number of entries fetched by one read when prefetch is unlimited.
    max_batch: int = 100
    #: How long a channel reuses a direct exchange's binding table before reading it
    #: again (ms). A routing key that matches nothing always reads it again at once;
    #: topic and fanout tables are read on every publish.
    binding_cache_ms: int = 1_000
    #: How long a consumer trusts that a queue has no cancel marks before looking again
    #: (ms); while a queue has marks, every read batch is checked.
    cancel_check_ms: int = 1_000
    #: Task bodies of at least this many bytes are gzip-compressed (None: never).
    gzip_min_bytes: int | None = DEFAULT_GZIP_MIN_BYTES
    #: How far ahead a task may be scheduled at publish (seconds).
    max_delay_s: float = 90 * 24 * 3600
    #: Deepest payload nesting accepted (the payload object itself is level 1).
    max_payload_depth: int = 5
    #: Largest payload accepted, as compact JSON (bytes).
    max_payload_bytes: int = 1024 * 1024
    #: Entries kept in the stream of a transient queue (auto-delete, or with a
    #: message TTL or expiry): events and remote-control traffic, never tasks.
    transient_maxlen: int = 1_000
    #: Dead-letter an entry after its consumer died this many times holding it
    #: (0: never). Guards against a task that kills every worker that runs it.
    max_redeliveries: int = 10
    #: ``module:attribute`` of the message adapter, or None for the default.
    message_adapter: str | None = None
    #: How long a command waits for an unreachable, restarting or loading Redis to
    #: come back before it fails (seconds; 0: fail at once). Only commands that are
    #: safe to repeat are retried (see :mod:`kombu_envelope.outages`).
    outage_tolerance_s: float = 30.0
    #: Seconds to wait for a reply on command connections (None: forever).
    socket_timeout: float | None = None
    #: Seconds to wait when connecting (None: forever).
    socket_connect_timeout: float | None = None
    #: Extra keyword arguments for the redis-py connection pool (ssl options...).
    connection_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_transport_options(cls, options: dict[str, Any] | None) -> Settings:
        """Settings from kombu ``transport_options``, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (options or {}).items() if k in names})

    @cached_property
    def keys(self) -> KeySpace:
        """Key builder for :attr:`key_prefix`."""
        return KeySpace(self.key_prefix)

    @property
    def publish_dedupe_ms(self) -> int:
        """How long a publish token is remembered (ms): past the retries of one publish."""
        return int(self.outage_tolerance_s * 1000) + 60_000

    @cached_property
    def limits(self) -> Limits:
        """Envelope validation limits."""
        return Limits(
            max_delay_s=self.max_delay_s,
            max_payload_depth=self.max_payload_depth,
            max_payload_bytes=self.max_payload_bytes,
        )
