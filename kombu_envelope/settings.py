"""Transport options: what they are called, their units and their defaults.

Celery users set them with ``broker_transport_options``; plain kombu users
pass ``transport_options`` to :class:`kombu.Connection`. Every option is a
field of :class:`Settings`, and its value must have the field's type.

Any other key is refused with :class:`~kombu_envelope.errors.InvalidTransportOption`
naming it, except the ones kombu itself reads (:data:`KOMBU_OPTIONS`). Options of
kombu's stock ``redis://`` transport that have no use here are refused with
the reason and what to use instead (:data:`STOCK_REDIS_OPTIONS`); the ones
with the same meaning here (``socket_timeout``, ``max_connections``...) are
fields of the same name.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cache, cached_property
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from kombu.transport import virtual

from kombu_envelope.codec import DEFAULT_GZIP_MIN_BYTES
from kombu_envelope.envelope import Limits
from kombu_envelope.errors import InvalidTransportOption
from kombu_envelope.keys import DEFAULT_GROUP, DEFAULT_PREFIX, KeySpace

#: Default of :attr:`Settings.lease_ms`.
DEFAULT_LEASE_MS = 30_000

#: Keys kombu reads from ``transport_options`` itself, on any transport: left to it.
KOMBU_OPTIONS = frozenset({
    # kombu.Connection.ensure(): Producer.publish(retry=True) adds its retry_policy
    # (Celery's task_publish_retry_policy) to the connection's transport_options.
    "errback", "max_retries", "interval_start", "interval_step", "interval_max",
    "on_revive", "retry_errors",
    # kombu.Connection.ensure_connection() also reads these.
    "connect_retries_timeout", "callback",
    # Every virtual channel (kombu.transport.virtual.Channel.from_transport_options):
    # body_encoding of non-task messages, deadletter_queue for unroutable ones.
    *virtual.Channel.from_transport_options,
})

_LEASE = ("a live worker renews its lease, so a task it runs is never handed to another "
          "worker however long it takes, and eta/countdown tasks wait in the delayed set, "
          "not in a worker; a dead worker's tasks go back to their stream lease_ms after it "
          "stopped renewing (see also max_redeliveries)")
_UNACKED = (f"unacknowledged tasks stay in their stream's pending list (acks are XACK), "
            f"not in an unacked hash: {_LEASE}")
_FANOUT = ("a fanout exchange copies each message into the stream of every bound queue, "
           "whatever its routing key, under key_prefix in the URL's database (not over "
           "PUB/SUB): there is nothing to set")
#: Options of kombu's ``redis://`` transport with no use on envelope://, and why.
STOCK_REDIS_OPTIONS: dict[str, str] = {
    "visibility_timeout": (
        f"{_LEASE}. Remove it; set lease_ms (milliseconds, default {DEFAULT_LEASE_MS}) to "
        f"choose how soon a dead worker's tasks are taken over"),
    "ack_emulation": f"acks are always real: {_UNACKED}",
    **{name: _UNACKED for name in (
        "unacked_key", "unacked_index_key", "unacked_mutex_key", "unacked_mutex_expire",
        "unacked_restore_limit", "unacked_restore_interval", "unacked_restore_throttle")},
    "priority_steps": (
        "each queue has three priority buckets (high, normal, low) for Envelope priorities "
        "0-255, and Celery's priorities 0-9 map onto them (celery_ext.priority): there are "
        "no steps to set"),
    "queue_order_strategy": (
        "one read takes from every consumed queue at once (in the order they are consumed "
        "when prefetch is below the number of streams): there is no order to choose"),
    "sep": "bindings are stored by envelope:// itself: there is no separator to set",
    "global_keyprefix": (
        "its equivalent is key_prefix: every envelope:// key starts with '<key_prefix>:' "
        f"(default {DEFAULT_PREFIX!r})"),
    "fanout_prefix": _FANOUT,
    "fanout_patterns": _FANOUT,
    "polling_interval": (
        "envelope:// never polls: a read blocks in Redis until an entry arrives (at most "
        "block_ms, in milliseconds)"),
    "reauth_check_interval": (
        "envelope:// runs no timer to re-authenticate its connections: there is nothing "
        "to set"),
    "sentinel_fanout_compat": (
        "envelope-sentinel:// keeps broadcasts in streams, not in PUB/SUB topics: there is no "
        "legacy topic to publish to"),
}

_TYPE_WORDS: dict[Any, str] = {
    bool: "true or false", int: "an integer", float: "a number", str: "a string",
    dict: "a dict", list: "a list", tuple: "a tuple", type(None): "None",
}


@dataclass(frozen=True)
class Settings:
    """Every transport option, with its unit in the name or the comment."""

    #: Prefix of every Redis key, so several apps can share one Redis.
    key_prefix: str = DEFAULT_PREFIX
    #: Consumer group that all workers of all languages join.
    consumer_group: str = DEFAULT_GROUP
    #: How long a consumer stays alive without renewing its liveness key (ms).
    #: Entries held by a consumer dead for this long go back to their stream.
    lease_ms: int = DEFAULT_LEASE_MS
    #: How long one blocking read waits for new entries (ms).
    block_ms: int = 1_000
    #: Largest number of entries fetched by one read when prefetch is unlimited.
    max_batch: int = 100
    #: How long a channel reuses a direct exchange's binding table before reading it
    #: again (ms). A routing key that matches nothing always reads it again at once;
    #: topic and fanout tables are read on every publish.
    binding_cache_ms: int = 1_000
    #: How long a consumer trusts that there are no cancel marks (``<prefix>:cancelled``
    #: does not exist) before looking again (ms); while there are, every read batch is
    #: checked.
    cancel_check_ms: int = 1_000
    #: How long a producer or worker uses the payload schemas it read before reading
    #: them again (seconds; 0: on every task): a schema registered now is enforced
    #: everywhere within this time.
    schema_cache_s: float = 30.0
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
    #: safe to repeat are retried (see :mod:`kombu_envelope.store.outages`).
    outage_tolerance_s: float = 30.0
    #: After each publish, idempotency claim and settling write (ack, done marker, retry,
    #: dead letter, requeue), wait until this many replicas have it (``WAIT``; 0: do not
    #: wait). Redis replicates asynchronously: without waiting, a failover can lose the
    #: last writes the primary acknowledged.
    wait_replicas: int = 0
    #: Longest ``WAIT`` for ``wait_replicas`` (ms; 0: wait forever). A ``WAIT`` answered by
    #: fewer replicas is logged and counted; the write itself stands.
    wait_timeout_ms: int = 1_000
    #: How long a task record is kept after its task ended (seconds; 0: write no records).
    #: A record of a task not ended yet is kept 7 days, or this long if longer, after its
    #: last write or its due time (docs/protocol.md, section 14).
    task_record_retention_s: int = 3_600
    #: How long a worker's announcement outlives its last renewal (seconds): a worker
    #: seen within this time counts as recently seen (docs/protocol.md, section 15).
    announce_keep_s: int = 3_600
    # redis-py connection options, named and meant as on kombu's redis:// transport.
    #: Seconds to wait for a reply on command connections (None: forever).
    socket_timeout: float | None = None
    #: Seconds to wait when connecting (None: forever).
    socket_connect_timeout: float | None = None
    #: TCP keepalive on every connection.
    socket_keepalive: bool = True
    #: TCP keepalive socket options (``{socket.TCP_KEEPIDLE: 60, ...}``; None: the system's).
    socket_keepalive_options: dict[int, int] | None = None
    #: Retry a command whose reply timed out (redis-py's ``retry_on_timeout``).
    retry_on_timeout: bool = False
    #: PING a connection idle for this long before using it (seconds; 0: never).
    health_check_interval: float = 0
    #: ``CLIENT SETNAME`` of every connection (None: no name).
    client_name: str | None = None
    #: Most connections one kombu connection opens; its channels share them, and each
    #: consuming channel holds one while it waits (None: no limit).
    max_connections: int | None = None
    #: Sentinel: the name of the monitored primary (``sentinel monitor <name> ...``);
    #: required with an ``envelope-sentinel://`` URL.
    master_name: str | None = None
    #: Sentinel: keyword arguments of the connections to the sentinels themselves
    #: (``password``, ``username``, ``ssl``...), as on kombu's sentinel transport.
    sentinel_kwargs: dict[str, Any] | None = None
    #: Sentinel: how many other sentinels the one asked must see before its answer counts.
    min_other_sentinels: int = 0
    #: Extra keyword arguments for the redis-py connection pool (ssl options...).
    connection_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = {}
        for name, hint in _field_types().items():
            value = getattr(self, name)
            if not _accepts(hint, value):
                problems[name] = f"must be {_describe(hint)}, not {value!r}"
        for name in ("wait_replicas", "wait_timeout_ms", "task_record_retention_s"):
            if isinstance(getattr(self, name), int) and getattr(self, name) < 0:
                problems[name] = f"must be 0 or more, not {getattr(self, name)!r}"
        if isinstance(self.announce_keep_s, int) and self.announce_keep_s < 1:
            problems["announce_keep_s"] = f"must be 1 or more, not {self.announce_keep_s!r}"
        if problems:
            raise InvalidTransportOption(problems)

    @classmethod
    def from_transport_options(cls, options: Mapping[str, Any] | None) -> Settings:
        """Settings from kombu ``transport_options``.

        Keys kombu reads itself (:data:`KOMBU_OPTIONS`) are left to it; any other key
        that is not a field raises :class:`InvalidTransportOption`, naming it and saying
        what to use instead.
        """
        options = dict(options or {})
        names = _field_types()
        problems = {key: _why_unknown(key) for key in options
                    if key not in names and key not in KOMBU_OPTIONS}
        if problems:
            raise InvalidTransportOption(problems)
        return cls(**{k: v for k, v in options.items() if k in names})

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


def option_names() -> list[str]:
    """Every transport option of envelope://, in the order :class:`Settings` declares them."""
    return list(_field_types())


@cache
def _field_types() -> dict[str, Any]:
    hints = get_type_hints(Settings)
    return {f.name: hints[f.name] for f in fields(Settings)}


def _why_unknown(key: str) -> str:
    if key in STOCK_REDIS_OPTIONS:
        return f"kombu's redis:// option, not used by envelope://: {STOCK_REDIS_OPTIONS[key]}"
    names = option_names()
    close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"unknown option{hint}; the options of envelope:// are {', '.join(names)}"


def _union_members(hint: Any) -> tuple[Any, ...]:
    if get_origin(hint) in (Union, types.UnionType):
        return get_args(hint)
    return (hint,)


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the type ``hint`` (a number may be an int; a bool is no number)."""
    for member in _union_members(hint):
        kind = get_origin(member) or member
        if kind is Literal:
            if value in get_args(member):
                return True
        elif kind is Any or not isinstance(kind, type):
            return True  # a hint this check does not model: left to the field's user
        elif kind is type(None):
            if value is None:
                return True
        elif isinstance(value, bool):
            if kind is bool:
                return True
        elif kind is float:
            if isinstance(value, (int, float)):
                return True
        elif isinstance(value, kind):
            return True
    return False


def _describe(hint: Any) -> str:
    words = []
    for member in _union_members(hint):
        kind = get_origin(member) or member
        if kind is Literal:
            words.append(" or ".join(repr(v) for v in get_args(member)))
        else:
            words.append(_TYPE_WORDS.get(kind, getattr(kind, "__name__", str(kind))))
    return " or ".join(words)
