"""One fault drill, from two private redis-servers to its report.

1. A ledger Redis (never killed) and a broker Redis with AOF (``appendfsync always``:
   every write Redis acknowledged is on disk when it is SIGKILLed, so what the restart
   brings back is exactly what clients were told was stored), or on the ``sentinel``
   topology a Sentinel group (:class:`~bench.drill.faults.SentinelFailovers` are its
   faults, and no worker is killed), or on ``cluster`` a Cluster
   (:class:`~bench.drill.faults.ClusterFaults`).
2. ``workers`` workers of ``languages`` (Celery prefork workers, and the Go, Node.js and
   Java peers of :mod:`bench.drill.peers`, built first), all ready before anything is
   published.
3. The burst (``burst`` delayed tasks due at one instant, if any) is published at once;
   then the producer publishes ``tasks`` over ``publish_s``; meanwhile a random worker
   is SIGKILLed (its whole process group) every ``kill_interval_s`` and replaced by one
   of its language, and the broker's Redis gets its faults.
4. Once publishing ends the kills stop (a worker that exits on its own is still
   replaced); the drill waits until every published task's order has had an effect,
   then until no task has started for a lease (each wait at most ``settle_timeout_s``).
5. The workers get a warm shutdown, and the ledger, the dead letters and what the
   broker still holds are counted (:mod:`bench.drill.tally`).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.drill.app import create_app
from bench.drill.brokers import Broker
from bench.drill.config import CLUSTER, ENVELOPE, PYTHON, DrillConfig
from bench.drill.faults import (
    ClusterFaults,
    Fleet,
    RedisOutage,
    SentinelFailovers,
    Supervisor,
    Timeline,
)
from bench.drill.ledger import KINDS, Ledger, Record
from bench.drill.peers import build_peers
from bench.drill.producer import Producer, Published, plan, plan_burst, queue_names
from bench.drill.report import DrillReport, log_problems
from bench.drill.tally import tally
from bench.drill.workers import DrillWorker, PeerSpec
from bench.sysinfo import machine_info
from kombu_envelope.store.client import client_for_url, close_client
from kombu_envelope.store.replies import as_text
from kombu_envelope.testing.cluster import PrivateRedisCluster
from kombu_envelope.testing.redis_server import PrivateRedisServer
from kombu_envelope.testing.sentinel import SentinelGroup

#: Longest wait for the first workers to be ready (seconds).
READY_TIMEOUT_S = 120.0
#: Time allowed per burst task to publish the burst before the drill begins (seconds; a
#: loaded 2-core machine publishes a 1,500-task burst in about 14 s).
BURST_PUBLISH_S = 0.01
#: Pause between two looks at the ledger while settling (seconds).
POLL_S = 0.25

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[drill {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_drill(config: DrillConfig, workdir: Path | None = None, log: Log = _stderr
              ) -> DrillReport:
    """Run one drill; worker logs, ``report.json`` and ``diagnostics.txt`` go to ``workdir``
    (default a new temporary directory)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="drill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = uuid.uuid4().hex[:10]
    rng = random.Random(config.seed)
    if set(config.languages) - {PYTHON}:
        log(f"building the workers of {', '.join(config.languages)}")
    peers = build_peers(config.languages)
    with PrivateRedisServer() as ledger_server, _broker_redis(config) as broker_redis:
        ledger = Ledger(redis.Redis.from_url(ledger_server.url), run)
        queues = tuple(queue_names(config))
        if isinstance(broker_redis, SentinelGroup):
            broker = Broker(config.broker, broker_redis.url, f"drill-{run}", queues,
                            sentinel=broker_redis)
        else:
            url = (broker_redis.url if isinstance(broker_redis, PrivateRedisCluster)
                   else f"{config.broker}://127.0.0.1:{broker_redis.port}/0")
            broker = Broker(config.broker, url, f"drill-{run}", queues)
        options = broker.transport_options(config)
        timeline = Timeline()
        peer = PeerSpec(peers, _sdk_url(broker_redis), broker.prefix, config.lease_ms,
                        config.wait_replicas)

        def make_worker(number: int, language: str) -> DrillWorker:
            return DrillWorker(f"w{number}.{run}@localhost", broker_url=broker.url,
                               transport_options=options, ledger_url=ledger_server.url,
                               run=run, concurrency=config.concurrency, log_dir=workdir,
                               queues=queues, language=language, peer=peer)

        fleet = Fleet(make_worker, config.workers, ledger, timeline, config.languages)
        app = create_app(broker.url, options)
        try:
            log(f"{broker.label}: starting {config.workers} workers (logs in {workdir})")
            fleet.start(READY_TIMEOUT_S)
            report = _drill(config, broker, broker_redis, ledger, fleet, app, timeline,
                            rng, log)
        finally:
            fleet.stop()
            app.close()
            ledger.client.close()
    (workdir / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n",
                                         encoding="utf-8")
    (workdir / "diagnostics.txt").write_text(report.diagnostics() + "\n", encoding="utf-8")
    return report


#: The broker's Redis under drill: one server, a Sentinel group or a Cluster.
BrokerRedis = PrivateRedisServer | SentinelGroup | PrivateRedisCluster


@contextlib.contextmanager
def _broker_redis(config: DrillConfig) -> Iterator[BrokerRedis]:
    """The broker's Redis: one server with AOF, a Sentinel group, or a Cluster of three
    primaries with a replica each (no AOF: a primary's data survives it only on its
    replica)."""
    if config.sentinel:
        with SentinelGroup() as group:
            yield group
    elif config.topology == CLUSTER:
        with PrivateRedisCluster() as cluster:
            yield cluster
    else:
        with PrivateRedisServer(appendonly=True) as server:
            yield server


@contextlib.contextmanager
def _broker_client(broker_redis: BrokerRedis, broker: Broker) -> Iterator[Any]:
    """A client on the broker's Redis (behind Sentinel, a plain one on its primary of
    the moment)."""
    if isinstance(broker_redis, SentinelGroup):
        with broker_redis.client(broker_redis.primary) as plain:
            yield plain
        return
    client = client_for_url(broker.url)
    try:
        yield client
    finally:
        close_client(client)


def _sdk_url(broker_redis: BrokerRedis) -> str:
    """The broker's Redis as the Go, Node.js and Java SDKs name it."""
    if isinstance(broker_redis, SentinelGroup):
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in broker_redis.sentinels)
        return f"redis-sentinel://{hosts}/0#{broker_redis.master_name}"
    if isinstance(broker_redis, PrivateRedisCluster):
        return "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in broker_redis.ports)
    return f"redis://127.0.0.1:{broker_redis.port}/0"


def _a_port(broker_redis: BrokerRedis) -> int:
    """The port of a data node of the broker's Redis (its primary behind Sentinel)."""
    if isinstance(broker_redis, PrivateRedisCluster):
        return broker_redis.primaries()[0]
    if isinstance(broker_redis, SentinelGroup):
        return broker_redis.primary.port
    return broker_redis.port


def _drill(config: DrillConfig, broker: Broker, broker_redis: BrokerRedis, ledger: Ledger,
           fleet: Fleet, app: Celery, timeline: Timeline, rng: random.Random, log: Log
           ) -> DrillReport:
    tasks = plan(config, rng)
    # The burst goes out first, as fast as it can, before the faults begin.
    t0 = time.time() + 0.2 + config.burst * BURST_PUBLISH_S
    burst = Producer(app, plan_burst(config, rng), config, time.time(), pace_s=0.0,
                     due_base=t0)
    if config.burst:
        log(f"publishing a burst of {config.burst} delayed tasks due at "
            f"+{config.burst_due_s:g} s, just before the fault on the primary holding them")
        burst.run()
        if time.time() > t0:
            burst.error = burst.error or RuntimeError(
                f"the burst took {time.time() - burst.start_at:.1f} s to publish, more than "
                f"its {t0 - burst.start_at:.1f} s")
    producer = Producer(app, tasks, config, t0)
    # On Sentinel the faults are Redis's only: a worker that exits is a finding.
    supervisor = Supervisor(fleet, rng, first_kill_at=t0 + config.first_kill_s,
                            interval_s=config.kill_interval_s,
                            kill_until=t0 if config.sentinel else t0 + config.publish_s)
    outage: RedisOutage | SentinelFailovers | ClusterFaults
    if isinstance(broker_redis, SentinelGroup):
        outage = SentinelFailovers(broker_redis, timeline, kill_at=t0 + config.redis_kill_at_s,
                                   down_s=config.redis_down_s,
                                   stall_at=t0 + config.stall_at_s, stall_s=config.stall_s)
        log(f"publishing {config.tasks} tasks over {config.publish_s:g} s on Sentinel "
            f"(wait_replicas {config.wait_replicas}); primary SIGKILLed at "
            f"+{config.redis_kill_at_s:g} s, the next one SIGSTOPped at "
            f"+{config.stall_at_s:g} s for {config.stall_s:g} s")
    else:
        if isinstance(broker_redis, PrivateRedisCluster):
            outage = ClusterFaults(
                broker_redis, timeline,
                queue_keys={queue: f"{broker.prefix}:{{{queue}}}:normal"
                            for queue in broker.queues},
                kill_at=t0 + config.primary_kill_at_s, failover_at=t0 + config.failover_at_s,
                reshard_at=t0 + config.reshard_at_s, stall_at=t0 + config.stall_at_s,
                stall_s=config.stall_s)
            faults = (f"a primary SIGKILLed at +{config.primary_kill_at_s:g} s, a CLUSTER "
                      f"FAILOVER at +{config.failover_at_s:g} s, a resharding at "
                      f"+{config.reshard_at_s:g} s, a primary SIGSTOPped at "
                      f"+{config.stall_at_s:g} s for {config.stall_s:g} s")
        else:
            outage = RedisOutage(broker_redis, timeline, kill_at=t0 + config.redis_kill_at_s,
                                 down_s=config.redis_down_s)
            faults = (f"Redis down at +{config.redis_kill_at_s:g} s for "
                      f"{config.redis_down_s:g} s")
        log(f"publishing {config.tasks} tasks over {config.publish_s:g} s to "
            f"{len(broker.queues)} queue(s) (wait_replicas {config.wait_replicas}); a worker "
            f"killed every {config.kill_interval_s:g} s, {faults}")
    timeline.note("publish-start", f"{len(burst.published)} burst tasks published before, "
                                   f"due at +{config.burst_due_s:g} s" if config.burst else "")
    for thread in (producer, supervisor, outage):
        thread.start()
    producer.join(timeout=config.publish_s + 300)
    producer.stopping.set()
    published = producer.published + burst.published
    not_published = producer.not_published + burst.not_published
    timeline.note("publish-end", f"{len(published)} published, {len(not_published)} not")
    published_at_end = time.time()
    outage.finish()
    log(f"published {len(producer.published)}; waiting for every effect "
        f"(at most {config.settle_timeout_s:g} s)")
    deadline = time.monotonic() + config.settle_timeout_s
    orders = {p.task.order_id for p in published}
    if _wait_for_effects(ledger, orders, deadline):
        timeline.note("all-effects")
        quiet = _wait_for_quiet(ledger, config.quiet_s,
                                time.monotonic() + config.settle_timeout_s)
        timeline.note("quiet" if quiet else "quiet-timeout", "" if quiet else
                      "tasks kept starting")
    else:
        timeline.note("settle-timeout")
    supervisor.stop()
    fleet.stop()
    timeline.note("workers-stopped")

    records = {kind: ledger.records(kind) for kind in KINDS}
    with _broker_client(broker_redis, broker) as client:
        dead = broker.dead_letters(client)
        leftovers = broker.leftovers(client)
    killed_at = {w.hostname: w.killed_at for w in fleet.killed if w.killed_at is not None}
    exited_at = {w.hostname: w.exited_at for w in fleet.exited if w.exited_at is not None}
    counted = tally(published, not_published, records, dead, killed_at, exited_at)
    report = DrillReport(
        config=config, broker=broker.label, tally=counted, timeline=timeline,
        seconds=time.time() - timeline.started,
        drain_s=_last_effect(records, published_at_end),
        published=published, not_published=not_published,
        dead_letters=dead, leftovers=leftovers, killed=fleet.killed, exited=fleet.exited,
        log_problems=log_problems(list(fleet.all.values())),
        harness_errors=_harness_errors(config, producer, burst, supervisor, outage, fleet,
                                       timeline, counted.runs_without_key),
        machine=machine_info(f"redis://127.0.0.1:{_a_port(broker_redis)}/0", None),
        fault_spans=outage.spans if isinstance(outage, ClusterFaults) else {},
        lossy_queues=outage.lossy_queues if isinstance(outage, ClusterFaults) else {},
        languages={w.hostname: w.language for w in fleet.all.values()},
        failover_s=getattr(outage, "failover_s", {}),
        lag_bytes=getattr(outage, "lag_bytes", {}),
        recovery_s=_recovery(records, published, timeline),
    )
    log(report.summary())
    return report


#: The faults whose recovery a drill measures.
FAULTS = ("redis-kill", "primary-kill", "failover", "reshard", "primary-stall")


def _recovery(records: dict[str, list[Record]], published: list[Published],
              timeline: Timeline) -> dict[str, float | None]:
    """Per fault, seconds from it to the first effect of a task published after it
    (None: no such effect)."""
    effect_at: dict[str, float] = {}
    for record in records["effects"]:
        effect_at.setdefault(record["order"], record["t"])
    found: dict[str, float | None] = {}
    for fault in FAULTS:
        for event in timeline.of(fault):
            times = [effect_at[p.task.order_id] - event.at for p in published
                     if p.at >= event.at and p.immediate
                     and p.task.order_id in effect_at]
            found[fault] = round(min(times), 2) if times else None
    return found


def _wait_for_effects(ledger: Ledger, orders: set[str], deadline: float) -> bool:
    """Wait until every order in ``orders`` had an effect; False at the deadline."""
    key = ledger.key("effect-count")
    while True:
        if orders <= {as_text(o) for o in ledger.client.hkeys(key)}:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def _last_effect(records: dict[str, list[Record]], since: float) -> float | None:
    """Seconds from ``since`` to the last effect recorded (None without any)."""
    last = max((r["t"] for r in records["effects"]), default=None)
    return None if last is None else last - since


def _wait_for_quiet(ledger: Ledger, quiet_s: float, deadline: float) -> bool:
    """Wait until no task started for ``quiet_s`` (a late redelivery would show by then)."""
    key = ledger.key("deliveries")
    while time.monotonic() < deadline:
        raw = ledger.client.lindex(key, -1)
        last = float(json.loads(raw)["t"]) if raw else 0.0
        if time.time() - last >= quiet_s:
            return True
        time.sleep(POLL_S)
    return False


def _harness_errors(config: DrillConfig, producer: Producer, burst: Producer,
                    supervisor: Supervisor,
                    outage: RedisOutage | SentinelFailovers | ClusterFaults, fleet: Fleet,
                    timeline: Timeline, runs_without_key: int) -> list[str]:
    """What kept the drill from testing what it claims to (then it fails, saying so)."""
    errors = [f"{name} thread failed: {thread.error!r}"
              for name, thread in (("producer", producer), ("burst producer", burst),
                                   ("supervisor", supervisor), ("Redis faults", outage))
              if thread.error is not None]
    if producer.is_alive():
        errors.append("the producer did not finish")
    if config.broker == ENVELOPE and runs_without_key:
        errors.append(f"{runs_without_key} task runs had no idempotency key: the drill "
                      "would not test idempotency")
    if isinstance(outage, SentinelFailovers):
        if len(timeline.of("new-primary")) < 2 or not timeline.of("primary-resume"):
            errors.append("the primary was not both killed and stalled with a failover each")
        elif not any(p.at > timeline.of("primary-resume")[0].at for p in producer.published):
            errors.append("nothing was published after the stalled primary came back")
        return errors
    if not fleet.killed:
        errors.append("no worker was killed")
    if isinstance(outage, ClusterFaults):
        missing = [kind for kind, _at in outage.plan if kind not in outage.spans]
        if missing:
            errors.append(f"Cluster faults not made: {', '.join(missing)}")
        if fleet.exited:
            errors.append(f"{len(fleet.exited)} workers exited on their own: a node failing "
                          "over must never stop a worker")
        return errors
    starts = timeline.of("redis-start")
    if not timeline.of("redis-kill") or not starts:
        errors.append("the broker's Redis was not killed and restarted")
    else:
        if outage.keys_after <= 0:
            errors.append(f"Redis came back with {outage.keys_after} keys: the AOF was "
                          "not loaded")
        if not any(p.at > starts[0].at for p in producer.published):
            errors.append("nothing was published after Redis came back")
    return errors
