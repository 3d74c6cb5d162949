"""Every Redis key name kombu-envelope uses, in one place.

All keys of one queue share the Redis Cluster hash tag ``{<queue>}`` so that
the Lua scripts, which touch several keys of one queue at once, stay valid on
a cluster. Keys that are not tied to a queue (bindings, consumer liveness,
the queue registry) are only ever used one at a time.

Layout for prefix ``envelope`` and queue ``celery``::

    envelope:{celery}:high          task stream, priority >= 170
    envelope:{celery}:normal        task stream, 85 <= priority < 170
    envelope:{celery}:low           task stream, priority < 85
    envelope:{celery}:kombu         non-task messages (events, replies, plain kombu)
    envelope:{celery}:delayed       ZSET task_id -> due time (ms since the Unix epoch)
    envelope:{celery}:delayed:data  HASH task_id -> stored entry
    envelope:{celery}:dead          dead-letter stream
    envelope:{celery}:replayed      records of replayed dead-letter entries
    envelope:{celery}:meta          HASH queue settings
    envelope:{celery}:periodic      HASH periodic entry name -> next occurrence (ms)
    envelope:queues                 SET of queue names that have delayed tasks
    envelope:dead-queues            SET of queue names that have dead-letter entries
    envelope:periodic-queues        SET of queue names that have periodic entries
    envelope:cancelled              ZSET task_id -> cancel time in ms, whatever the queue
    envelope:binding:<exchange>     SET of bindings of an exchange
    envelope:consumer:<name>        liveness of a consumer (expires after the lease)
    envelope:idem:<task_type>:<key> idempotency claim / done marker
    envelope:retrying:<task_type>   ZSET of running retries (concurrency cap)
    envelope:wakeup                 pub/sub channel that wakes delayed-task promoters
    envelope:{celery}:task:<id>     HASH task record (expires)
    envelope:workers                ZSET consumer -> when it last announced itself (ms)
    envelope:worker:<consumer>      STRING announcement of a worker (expires)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property, lru_cache

from kombu_envelope.errors import InvalidQueueName

#: Default prefix of every key.
DEFAULT_PREFIX = "envelope"

#: Name of the consumer group every worker of every language joins, on every stream.
DEFAULT_GROUP = "workers"


class Bucket(str, Enum):
    """Priority buckets of a queue, most urgent first."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


#: Buckets in the order consumers read them: a higher bucket is always served first.
BUCKETS_BY_URGENCY: tuple[Bucket, ...] = (Bucket.HIGH, Bucket.NORMAL, Bucket.LOW)

#: Lowest priority value that lands in the HIGH bucket.
HIGH_PRIORITY_FROM = 170
#: Lowest priority value that lands in the NORMAL bucket.
NORMAL_PRIORITY_FROM = 85


def bucket_for(priority: int) -> Bucket:
    """Return the bucket an Envelope of ``priority`` (0-255, higher first) goes to."""
    if priority >= HIGH_PRIORITY_FROM:
        return Bucket.HIGH
    if priority >= NORMAL_PRIORITY_FROM:
        return Bucket.NORMAL
    return Bucket.LOW


def _check_queue_name(queue: str) -> None:
    if not queue or "{" in queue or "}" in queue:
        raise InvalidQueueName(
            f"queue name {queue!r} must be non-empty and contain no '{{' or '}}' "
            "(it becomes a Redis Cluster hash tag)"
        )


@dataclass(frozen=True)
class QueueKeys:
    """The keys of one queue (the ones every publish names are made once)."""

    prefix: str
    queue: str

    @cached_property
    def base(self) -> str:
        """Common start of every key of this queue: ``<prefix>:{<queue>}``."""
        return f"{self.prefix}:{{{self.queue}}}"

    def stream(self, bucket: Bucket) -> str:
        """Task stream of one priority bucket."""
        return f"{self.base}:{bucket.value}"

    @property
    def task_streams(self) -> tuple[str, ...]:
        """Task streams, most urgent first."""
        return tuple(self.stream(b) for b in BUCKETS_BY_URGENCY)

    @property
    def kombu_stream(self) -> str:
        """Stream of non-task messages (events, remote-control replies, plain kombu)."""
        return f"{self.base}:kombu"

    @property
    def all_streams(self) -> tuple[str, ...]:
        """Every stream a consumer of this queue reads, in reading order."""
        return (*self.task_streams, self.kombu_stream)

    def published(self, task_id: str) -> str:
        """STRING ``"<publish token> <result>"``: the last publish of ``task_id``,
        kept a while so that a publish retried after a lost reply is stored once."""
        return f"{self.base}:published:{task_id}"

    def task_record(self, task_id: str) -> str:
        """HASH of what became of ``task_id`` (docs/protocol.md, section 14); it expires."""
        return f"{self.base}:task:{task_id}"

    @cached_property
    def delayed(self) -> str:
        """ZSET of delayed task ids scored by due time in milliseconds."""
        return f"{self.base}:delayed"

    @cached_property
    def delayed_data(self) -> str:
        """HASH of delayed task id to stored entry."""
        return f"{self.base}:delayed:data"

    @property
    def dead(self) -> str:
        """Dead-letter stream."""
        return f"{self.base}:dead"

    def dead_once(self, token: str) -> str:
        """STRING with expiry: the dead letter written for ``token`` (an outbox row), so
        that a relay that died before deleting the row does not write it twice."""
        return f"{self.base}:dead-once:{token}"

    @property
    def replayed(self) -> str:
        """Stream of records of replayed dead-letter entries."""
        return f"{self.base}:replayed"

    @property
    def periodic(self) -> str:
        """HASH of periodic entry name to its next occurrence (ms), plus fingerprints."""
        return f"{self.base}:periodic"

    @property
    def meta(self) -> str:
        """HASH of queue settings (for example whether the queue is transient)."""
        return f"{self.base}:meta"

    @property
    def stats(self) -> str:
        """HASH of the counts workers keep of runs, outcomes and waits (section 17)."""
        return f"{self.base}:stats"

    @property
    def limits(self) -> str:
        """HASH of task type to its limits on this queue, JSON (section 19)."""
        return f"{self.base}:limits"

    def running(self, task_type: str) -> str:
        """ZSET of the concurrency slots of ``task_type`` held now, ``"<stream> <entry id>"``
        scored by deadline in ms (section 19)."""
        return f"{self.base}:running:{task_type}"

    @property
    def slot_freed(self) -> str:
        """STREAM of at most one entry, appended to when a slot frees; exists only while
        entries wait for a slot (section 19)."""
        return f"{self.base}:slot-freed"

    def breaker(self, task_type: str) -> str:
        """HASH of the circuit breaker of ``task_type``: state, since... (section 19)."""
        return f"{self.base}:breaker:{task_type}"

    def parked(self, task_type: str) -> str:
        """LIST of ``"<stream> <entry id>"`` of entries waiting for their type's limits."""
        return f"{self.base}:parked:{task_type}"

    def order(self, key: str) -> str:
        """LIST of the ``task_id`` s of ordering key ``key`` in the order they joined; the
        head's turn (section 20)."""
        return f"{self.base}:order:{key}"

    def order_waiting(self, key: str) -> str:
        """HASH of ``task_id`` to ``"<bucket>\\n<enc>\\n<body>"``: the tasks of ``key``
        waiting for their turn, in no stream (section 20)."""
        return f"{self.base}:order-waiting:{key}"

    @property
    def order_advanced(self) -> str:
        """LIST of ordering keys whose head was settled, for the promoters (section 20)."""
        return f"{self.base}:order-advanced"

    @property
    def order_held(self) -> str:
        """ZSET of ``"<key>\\n<task_id>\\n<stream>\\n<entry id>"`` scored by deadline:
        keys held by runs acknowledged before they end (section 20)."""
        return f"{self.base}:order-held"

    @property
    def order_policy(self) -> str:
        """HASH of task type to ``advance`` or ``halt``: what a dead-lettered head does to
        its ordering key (section 20)."""
        return f"{self.base}:order-policy"

    @property
    def order_halted(self) -> str:
        """HASH of ordering key to the ``task_id`` of the dead-lettered head it waits for."""
        return f"{self.base}:order-halted"


@dataclass(frozen=True)
class KeySpace:
    """Builds key names under one prefix, so several apps can share one Redis."""

    prefix: str = DEFAULT_PREFIX

    def queue(self, name: str) -> QueueKeys:
        """Keys of queue ``name``."""
        return _queue_keys(self.prefix, name)

    @property
    def queues(self) -> str:
        """SET of names of queues that have (or had) delayed tasks."""
        return f"{self.prefix}:queues"

    @property
    def dead_queues(self) -> str:
        """SET of names of queues that have dead-letter entries."""
        return f"{self.prefix}:dead-queues"

    @property
    def periodic_queues(self) -> str:
        """SET of names of queues that have periodic entries."""
        return f"{self.prefix}:periodic-queues"

    @property
    def cancelled(self) -> str:
        """ZSET of cancelled task ids, whatever their queue, scored by cancel time (ms)."""
        return f"{self.prefix}:cancelled"

    def binding(self, exchange: str) -> str:
        """SET of bindings of ``exchange``."""
        return f"{self.prefix}:binding:{exchange}"

    def consumer(self, consumer: str) -> str:
        """Liveness key of consumer ``consumer``; it expires when the consumer dies."""
        return f"{self.prefix}:consumer:{consumer}"

    def idempotency(self, task_type: str, key: str) -> str:
        """Idempotency claim / done marker of ``key`` for tasks of ``task_type``."""
        return f"{self.prefix}:idem:{task_type}:{key}"

    def retrying(self, task_type: str) -> str:
        """ZSET of retries of ``task_type`` running now (the retry concurrency cap)."""
        return f"{self.prefix}:retrying:{task_type}"

    @property
    def schemas(self) -> str:
        """HASH of ``<task_type>@<payload_version>`` to the payload's JSON Schema."""
        return f"{self.prefix}:schemas"

    @property
    def workers(self) -> str:
        """ZSET of consumers that announced themselves, scored by when they last did (ms)."""
        return f"{self.prefix}:workers"

    def worker(self, consumer: str) -> str:
        """STRING holding the announcement of ``consumer`` (JSON); it expires."""
        return f"{self.prefix}:worker:{consumer}"

    @property
    def wakeup_channel(self) -> str:
        """Pub/sub channel on which publishers wake the delayed-task promoters."""
        return f"{self.prefix}:wakeup"


@lru_cache(maxsize=4096)
def _queue_keys(prefix: str, name: str) -> QueueKeys:
    _check_queue_name(name)
    return QueueKeys(prefix, name)
