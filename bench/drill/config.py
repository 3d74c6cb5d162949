"""The sizes and timings of one fault drill."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Brokers the drill knows: kombu-envelope's, and Celery's stock Redis transport.
ENVELOPE = "envelope"
STOCK = "redis"
BROKERS = (ENVELOPE, STOCK)
#: Where the broker's data lives: one redis-server, a Sentinel group (a primary, two
#: replicas, three sentinels), or a Cluster of three primaries with one replica each
#: (the last two envelope:// only).
SINGLE = "single"
SENTINEL = "sentinel"
CLUSTER = "cluster"
TOPOLOGIES = (SINGLE, SENTINEL, CLUSTER)
#: Languages of the drill's workers: Celery, and the Go, Node.js and Java peers
#: (``tests/interop/{go,node,java}``, their ``drill`` handlers).
PYTHON = "python"
LANGUAGES = (PYTHON, "go", "node", "java")


#: How long before its fault the burst is due (seconds): the fault strikes while the
#: promoters move it.
BURST_LEAD_S = 0.05


@dataclass(frozen=True)
class DrillConfig:
    """What one drill does; times are seconds from the moment publishing starts."""

    #: ``envelope`` (kombu-envelope) or ``redis`` (Celery's stock transport).
    broker: str = ENVELOPE
    #: ``single``: one redis-server, SIGKILLed and restarted from its AOF, and workers
    #: SIGKILLed. ``sentinel``: a Sentinel group whose primary is SIGKILLed at
    #: ``redis_kill_at_s`` (and started again ``redis_down_s`` later, to rejoin as a
    #: replica), then SIGSTOPped at ``stall_at_s`` for ``stall_s``; no worker is killed.
    #: ``cluster``: the Cluster's faults: the primary of the first queue is SIGKILLed at
    #: ``primary_kill_at_s`` (its replica takes over), the replica of the last queue's
    #: primary is promoted with ``CLUSTER FAILOVER`` at ``failover_at_s``, the first
    #: queue's slot is moved to another primary at ``reshard_at_s``, and a primary is
    #: SIGSTOPped at ``stall_at_s`` for ``stall_s``; the single Redis's kill and restart
    #: (``redis_*``) do not apply.
    topology: str = SINGLE
    #: Languages of the workers, round robin over ``workers`` (a killed worker is replaced
    #: by one of its language).
    languages: tuple[str, ...] = (PYTHON,)
    #: ``wait_replicas`` of envelope:// (0: no WAIT).
    wait_replicas: int = 0
    #: Sentinel: when the primary of the moment is SIGSTOPped, and for how long (make
    #: it longer than the lease and than failure detection). Cluster: when a primary
    #: with a replica is SIGSTOPped, and for how long (longer than the lease and than
    #: ``cluster-node-timeout``, so its replica is promoted; it rejoins as a replica).
    stall_at_s: float = 11.0
    stall_s: float = 5.0
    #: ``socket_timeout`` of envelope:// on Sentinel (seconds): how soon a command or a
    #: blocking read sent to a stalled primary gives up and finds the new one.
    socket_timeout_s: float = 2.0
    #: Tasks the producer tries to publish, at an even pace over ``publish_s``.
    tasks: int = 200
    publish_s: float = 16.0
    #: Share of the tasks published with a countdown drawn from ``countdown_s``.
    delayed_fraction: float = 0.2
    countdown_s: tuple[float, float] = (1.0, 5.0)
    #: How long each task body works between its start and its effect (ms, drawn).
    work_ms: tuple[int, int] = (100, 400)
    #: Prefork workers kept running, and pool processes per worker.
    workers: int = 3
    concurrency: int = 2
    #: A random ready worker is SIGKILLed (main process and pool) this often, from
    #: ``first_kill_s`` until publishing ends, and replaced at once.
    kill_interval_s: float = 5.0
    first_kill_s: float = 2.0
    #: The broker's redis-server is SIGKILLed at ``redis_kill_at_s`` and started again
    #: from its AOF on the same port ``redis_down_s`` later (once per drill).
    redis_kill_at_s: float = 8.5
    redis_down_s: float = 3.0
    #: ``lease_ms`` of envelope://; stock redis:// gets ``visibility_timeout_s`` instead.
    lease_ms: int = 3000
    visibility_timeout_s: float = 10.0
    #: After publishing: longest wait for every published task's effect, then for the
    #: broker to be quiet (no new start for a lease, or a visibility timeout).
    settle_timeout_s: float = 60.0
    #: Seed of every random choice (delayed tasks, countdowns, work, victims).
    seed: int = 9
    #: Queues the tasks are spread over (round robin); on a Cluster, over every shard.
    queues: int = 1
    #: Delayed tasks published at once, all due at one instant (many more than one
    #: promoter batch, 1000): due just before the primary holding them is SIGKILLed
    #: (Sentinel, ``redis_kill_at_s``) or failed over (Cluster, ``failover_at_s``), so
    #: the fault strikes while they are being promoted. Each works ``burst_work_ms``.
    burst: int = 0
    burst_work_ms: tuple[int, int] = (1, 10)
    primary_kill_at_s: float = 4.0
    failover_at_s: float = 8.0
    reshard_at_s: float = 11.0

    def __post_init__(self) -> None:
        if self.broker not in BROKERS:
            raise ValueError(f"broker must be one of {BROKERS}, not {self.broker!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, not {self.topology!r}")
        if self.topology == CLUSTER and self.broker != ENVELOPE:
            raise ValueError("a Cluster drill runs on envelope:// only (the stock redis:// "
                             "transport does not serve a Redis Cluster)")
        if not self.languages or set(self.languages) - set(LANGUAGES):
            raise ValueError(f"languages must be among {LANGUAGES}, not {self.languages!r}")
        if self.burst < 0 or (self.burst and self.topology == SINGLE):
            raise ValueError("burst must be >= 0, and 0 on the single topology")
        if self.queues < 1:
            raise ValueError("queues must be at least 1")
        if self.topology == CLUSTER and not (
                0 < self.primary_kill_at_s < self.failover_at_s < self.reshard_at_s
                < self.publish_s):
            raise ValueError("the Cluster's faults must come in the order primary kill, "
                             "failover, resharding, all while publishing")
        if self.topology == CLUSTER and not (
                self.reshard_at_s < self.stall_at_s < self.stall_at_s + self.stall_s
                < self.publish_s and self.stall_s * 1000 > self.lease_ms):
            raise ValueError("on a Cluster the primary stall comes after the resharding, ends "
                             "while publishing, and lasts longer than the lease (lease_ms)")
        if self.topology == SENTINEL:
            if self.broker != ENVELOPE:
                raise ValueError("the sentinel topology drills envelope:// only")
            if not (self.redis_kill_at_s + self.redis_down_s <= self.stall_at_s
                    and self.stall_at_s + self.stall_s < self.publish_s):
                raise ValueError("on sentinel the primary is killed, restarted, then stalled, "
                                 "all while publishing: redis_kill_at_s + redis_down_s <= "
                                 "stall_at_s and stall_at_s + stall_s < publish_s")
            if self.stall_s * 1000 <= self.lease_ms:
                raise ValueError("stall_s must be longer than the lease (lease_ms)")
        if self.tasks < 1 or self.workers < 1 or self.concurrency < 1:
            raise ValueError("tasks, workers and concurrency must be at least 1")
        if not 0 <= self.delayed_fraction <= 1:
            raise ValueError("delayed_fraction must be between 0 and 1")
        if self.topology == SINGLE and self.redis_kill_at_s + self.redis_down_s >= self.publish_s:
            raise ValueError("Redis must be back before publishing ends: the drill restarts "
                             "it while the producer keeps publishing")
        if self.kill_interval_s <= 0 or self.first_kill_s >= self.publish_s:
            raise ValueError("at least one worker must be killed while publishing")

    @property
    def sentinel(self) -> bool:
        """Whether the broker's Redis is a Sentinel group."""
        return self.topology == SENTINEL

    @property
    def loss_allowed(self) -> bool:
        """A failover without WAIT may lose the writes the replicas had not copied yet:
        the drill then reports the loss rather than fail on it."""
        return self.sentinel and not self.wait_replicas

    @property
    def burst_due_s(self) -> float:
        """When the burst is due: just before the fault aimed at it."""
        return (self.failover_at_s if self.topology == CLUSTER
                else self.redis_kill_at_s) - BURST_LEAD_S

    @property
    def delayed(self) -> int:
        """How many of the tasks are published with a countdown."""
        return round(self.tasks * self.delayed_fraction)

    @property
    def quiet_s(self) -> float:
        """How long no task may start before the broker counts as settled."""
        if self.broker == ENVELOPE:
            return self.lease_ms / 1000 + 2.0
        return self.visibility_timeout_s + 2.0

    def replace(self, **changes: Any) -> DrillConfig:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return dataclasses.asdict(self)


#: The suite's drill: small enough for CI (about a minute on two cores).
SMALL = DrillConfig()

#: The Cluster drill of the suite's size (tests/test_cluster.py has its own, smaller):
#: a task lost in the no-WAIT window keeps the drill waiting ``settle_timeout_s``.
SMALL_CLUSTER = DrillConfig(topology=CLUSTER, queues=3, tasks=120, workers=4,
                            publish_s=20.0, stall_at_s=13.0, stall_s=5.0, burst=1500,
                            settle_timeout_s=20.0)

#: The drill whose figures docs/operations.md reports.
LARGE = DrillConfig(tasks=2000, publish_s=120.0, workers=4, concurrency=2,
                    kill_interval_s=5.0, first_kill_s=3.0, redis_kill_at_s=44.0,
                    redis_down_s=3.0, settle_timeout_s=180.0)

#: The suite's Sentinel drill: about a minute.
SENTINEL_SMALL = SMALL.replace(topology=SENTINEL, tasks=120, workers=4, publish_s=20.0,
                               redis_kill_at_s=7.5, redis_down_s=3.0, stall_at_s=11.0,
                               stall_s=5.0, burst=1500, settle_timeout_s=25.0)

#: The Sentinel drill whose figures docs/operations.md reports.
SENTINEL_LARGE = LARGE.replace(topology=SENTINEL, redis_kill_at_s=30.0, redis_down_s=3.0,
                               stall_at_s=70.0, stall_s=8.0, burst=3000)

#: The Cluster drill whose figures docs/operations.md reports.
CLUSTER_LARGE = LARGE.replace(topology=CLUSTER, queues=3, primary_kill_at_s=20.0,
                              failover_at_s=45.0, reshard_at_s=70.0, stall_at_s=90.0,
                              stall_s=8.0, burst=3000)
