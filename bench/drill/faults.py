"""The drill's faults: workers SIGKILLed and replaced, the broker's Redis SIGKILLed and
restarted from its AOF, a Sentinel group's primary killed and stalled, or, on a Cluster,
a primary killed, a replica promoted, a slot moved and a primary stalled; and the
timeline of what happened when."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from bench.drill.ledger import Ledger
from bench.drill.workers import DrillWorker
from kombu_envelope.testing.cluster import PrivateRedisCluster
from kombu_envelope.testing.redis_server import PrivateRedisServer
from kombu_envelope.testing.sentinel import SentinelGroup

#: How often the supervisor looks at its workers (seconds).
CHECK_INTERVAL_S = 0.2


@dataclass(frozen=True)
class Event:
    """Something the drill did or saw, ``at`` seconds (epoch)."""

    at: float
    kind: str
    detail: str


@dataclass
class Timeline:
    """Events of one drill, from any thread."""

    started: float = field(default_factory=time.time)
    events: list[Event] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, kind: str, detail: str = "") -> Event:
        """Record an event now."""
        event = Event(time.time(), kind, detail)
        with self._lock:
            self.events.append(event)
        return event

    def of(self, kind: str) -> list[Event]:
        """Events of ``kind``, oldest first."""
        with self._lock:
            return [event for event in self.events if event.kind == kind]

    def lines(self) -> list[str]:
        """One line per event, ``+seconds kind detail``."""
        with self._lock:
            return [f"+{e.at - self.started:6.1f}s {e.kind} {e.detail}".rstrip()
                    for e in self.events]


class Fleet:
    """Keeps ``size`` workers running, of ``languages`` round robin; kills one on demand
    and replaces it at once with one of the same language."""

    def __init__(self, make_worker: Callable[[int, str], DrillWorker], size: int,
                 ledger: Ledger, timeline: Timeline, languages: tuple[str, ...] = ("python",)
                 ) -> None:
        self.make_worker = make_worker
        self.size = size
        self.languages = languages
        self.ledger = ledger
        self.timeline = timeline
        self.running: list[DrillWorker] = []
        #: Every worker ever started, for the report (hostname -> worker).
        self.all: dict[str, DrillWorker] = {}
        self.killed: list[DrillWorker] = []
        self.exited: list[DrillWorker] = []
        self._started = 0

    def start_one(self, language: str) -> DrillWorker:
        """Start a new ``language`` worker (not waiting for it to be ready)."""
        self._started += 1
        worker = self.make_worker(self._started, language).start()
        self.running.append(worker)
        self.all[worker.hostname] = worker
        self.timeline.note("worker-start", f"{worker.hostname} ({language})")
        return worker

    def start(self, timeout: float) -> None:
        """Start ``size`` workers and wait until every one is ready."""
        for number in range(self.size):
            self.start_one(self.languages[number % len(self.languages)])
        deadline = time.monotonic() + timeout
        while not all(w.hostname in self.ledger.ready_hosts() for w in self.running):
            self.replace_exited()
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {w.hostname} ---\n{w.log_tail()}" for w in self.running)
                raise RuntimeError(f"workers not ready within {timeout:.0f} s:\n{tails}")
            time.sleep(CHECK_INTERVAL_S)

    def replace_exited(self) -> None:
        """Note every worker that exited on its own, and start one in its place."""
        for worker in [w for w in self.running if w.exit_code() is not None]:
            worker.exited_at = time.time()
            worker.stop()  # its pool processes may outlive it
            self.running.remove(worker)
            self.exited.append(worker)
            self.timeline.note("worker-exit", f"{worker.hostname} status {worker.exit_code()}")
            self.start_one(worker.language)

    def kill_one(self, rng: random.Random) -> DrillWorker | None:
        """SIGKILL a random ready worker's process group and start a replacement."""
        ready = self.ledger.ready_hosts()
        candidates = [w for w in self.running if w.hostname in ready and w.exit_code() is None]
        if not candidates:
            return None
        victim = rng.choice(candidates)
        hit = victim.kill()
        self.running.remove(victim)
        self.killed.append(victim)
        self.timeline.note("worker-kill", f"{victim.hostname} ({victim.language}, {hit} "
                                          "processes)")
        self.start_one(victim.language)
        return victim

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown of every running worker at once."""
        for worker in self.running:
            worker.terminate()
        deadline = time.monotonic() + timeout
        for worker in self.running:
            worker.stop(timeout=max(deadline - time.monotonic(), 0.1))
        self.running = []


class Supervisor(threading.Thread):
    """Replaces workers that exit; kills one every ``interval_s`` within a time window.

    When no worker is ready at a kill's time (all starting, or waiting for Redis), the
    kill waits for the first one that is, up to the next kill's time.
    """

    def __init__(self, fleet: Fleet, rng: random.Random, *, first_kill_at: float,
                 interval_s: float, kill_until: float) -> None:
        super().__init__(name="drill-supervisor", daemon=True)
        self.fleet = fleet
        self.rng = rng
        self.next_kill = first_kill_at
        self.interval_s = interval_s
        self.kill_until = kill_until
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self.stopping.wait(CHECK_INTERVAL_S):
            try:
                self.fleet.replace_exited()
                now = time.time()
                if self.next_kill <= now < self.kill_until:
                    if self.fleet.kill_one(self.rng) is not None:
                        self.next_kill += self.interval_s
                    elif now >= self.next_kill + self.interval_s:
                        self.fleet.timeline.note("kill-skipped", "no worker was ready")
                        self.next_kill += self.interval_s
            except Exception as exc:  # the drill fails on it, but supervision goes on
                self.error = self.error or exc
                self.fleet.timeline.note("supervisor-error", repr(exc))

    def stop(self) -> None:
        """Stop supervising (workers keep running)."""
        self.stopping.set()
        self.join(timeout=60)


class RedisOutage(threading.Thread):
    """SIGKILL the broker's redis-server at ``kill_at``; start it again ``down_s`` later."""

    def __init__(self, server: PrivateRedisServer, timeline: Timeline, *, kill_at: float,
                 down_s: float) -> None:
        super().__init__(name="drill-redis-outage", daemon=True)
        self.server = server
        self.timeline = timeline
        self.kill_at = kill_at
        self.down_s = down_s
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        self.keys_before = self.keys_after = -1

    def run(self) -> None:
        try:
            if self.cancelled.wait(max(self.kill_at - time.time(), 0)):
                return
            port = self.server.port
            self.keys_before = self._dbsize()
            self.server.kill()
            self.timeline.note("redis-kill", f"port {port}, {self.keys_before} keys")
            time.sleep(self.down_s)  # the outage itself
            self.server.start()
            if self.server.port != port:
                raise RuntimeError(f"redis-server came back on port {self.server.port}, "
                                   f"not {port}")
            self.keys_after = self._dbsize()
            self.timeline.note("redis-start", f"port {port}, {self.keys_after} keys from AOF")
        except BaseException as exc:
            self.error = exc
            self.timeline.note("redis-error", repr(exc))

    def _dbsize(self) -> int:
        with redis.Redis.from_url(self.server.url) as client:
            return int(client.dbsize())

    def finish(self) -> None:
        """Wait for the outage to be over (or cancel it if it has not begun)."""
        self.cancelled.set()
        self.join(timeout=60)


class ClusterFaults(threading.Thread):
    """The faults of a Cluster drill, each at its time, each timed until the Cluster is
    whole again (``cluster_state:ok``, every slot served):

    * ``primary-kill``: SIGKILL of the primary that serves ``queue``'s slot; its replica
      is elected (about two ``cluster-node-timeout``) and the killed node stays down;
    * ``failover``: ``CLUSTER FAILOVER`` on a replica of the primary that serves the
      last queue, where the burst (if any) is due just before: a planned, lossless
      promotion while the promoters move the burst (another primary's replica when
      that one has none left);
    * ``reshard``: ``queue``'s slot, with its keys, moved to another primary;
    * ``primary-stall``: SIGSTOP of a primary with a replica for ``stall_s`` (longer
      than the lease and than ``cluster-node-timeout``): its replica is promoted; after
      SIGCONT it rejoins as a replica, and the writes it took meanwhile are lost.
    """

    def __init__(self, cluster: PrivateRedisCluster, timeline: Timeline, *,
                 queue_keys: dict[str, str], kill_at: float, failover_at: float,
                 reshard_at: float, stall_at: float, stall_s: float) -> None:
        """``queue_keys``: a key of each queue of the drill, the first queue first."""
        super().__init__(name="drill-cluster-faults", daemon=True)
        self.cluster = cluster
        self.timeline = timeline
        self.queue_keys = queue_keys
        self.queue_key = next(iter(queue_keys.values()))
        self.stall_s = stall_s
        #: Per fault that loses writes (``primary-kill``, ``primary-stall``), the queues
        #: whose slots its primary served.
        self.lossy_queues: dict[str, list[str]] = {}
        self.plan = (("primary-kill", kill_at), ("failover", failover_at),
                     ("reshard", reshard_at), ("primary-stall", stall_at))
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        #: Fault kind -> (began, Cluster whole again), epoch seconds.
        self.spans: dict[str, tuple[float, float]] = {}

    def run(self) -> None:
        try:
            for kind, at in self.plan:
                if self.cancelled.wait(max(at - time.time(), 0)):
                    return
                began = time.time()
                detail = getattr(self, "_" + kind.replace("-", "_"))()
                self.spans[kind] = (began, time.time())
                self.timeline.note(kind, f"{detail}; whole again after "
                                         f"{self.spans[kind][1] - began:.1f} s")
        except BaseException as exc:
            self.error = exc
            self.timeline.note("cluster-error", repr(exc))

    def _slot(self) -> int:
        return self.cluster.keyslot(self.queue_key)

    def _queues_of(self, primary: int) -> list[str]:
        return [queue for queue, key in self.queue_keys.items()
                if self.cluster.owner_of(self.cluster.keyslot(key)) == primary]

    def _primary_kill(self) -> str:
        victim = self.cluster.owner_of(self._slot())
        self.lossy_queues["primary-kill"] = self._queues_of(victim)
        self.cluster.kill(victim)
        return (f"primary {victim} (slot {self._slot()}) killed; "
                f"{self.cluster.owner_of(self._slot())} serves it")

    def _failover(self) -> str:
        last_key = list(self.queue_keys.values())[-1]
        primary = self.cluster.owner_of(self.cluster.keyslot(last_key))
        if not self.cluster.replicas_of(primary):
            owner = self.cluster.owner_of(self._slot())
            primary = next(port for port in self.cluster.primaries() if port != owner)
        replica = self.cluster.replicas_of(primary)[0]
        queues = self._queues_of(primary)
        self.cluster.failover(replica)
        return f"replica {replica} of {primary} promoted (queues {', '.join(queues) or '-'})"

    def _primary_stall(self) -> str:
        victim = next(port for port in self.cluster.primaries()
                      if self.cluster.replicas_of(port))
        self.lossy_queues["primary-stall"] = self._queues_of(victim)
        stopped = time.time()
        self.cluster.pause(victim)
        self.cluster.wait_ok(failover_of=victim)
        promoted_s = time.time() - stopped
        time.sleep(max(stopped + self.stall_s - time.time(), 0))
        self.cluster.resume(victim)
        deadline = time.monotonic() + 30
        while any(node.port == victim and node.primary for node in self.cluster.nodes(victim)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"primary {victim} did not rejoin as a replica")
            time.sleep(0.05)
        self.cluster.wait_ok()
        return (f"primary {victim} SIGSTOPped for {self.stall_s:g} s (queues "
                f"{', '.join(self.lossy_queues['primary-stall']) or '-'}); its replica took "
                f"over after {promoted_s:.1f} s; SIGCONT, it rejoined as a replica")

    def _reshard(self) -> str:
        owner = self.cluster.owner_of(self._slot())
        target = next(port for port in self.cluster.primaries() if port != owner)
        self.cluster.move_slot(self._slot(), to=target)
        return f"slot {self._slot()} moved from {owner} to {target}"

    def finish(self) -> None:
        """Wait for the faults to be over (or cancel those that have not begun)."""
        self.cancelled.set()
        self.join(timeout=120)


class SentinelFailovers(threading.Thread):
    """A Sentinel group's primary SIGKILLed at ``kill_at`` (started again ``down_s`` later,
    to rejoin as a replica), then the primary of the moment SIGSTOPped at ``stall_at`` for
    ``stall_s`` (a network stall longer than the lease) and resumed.

    ``failover_s`` holds, per fault, the seconds from the fault until the sentinels
    named a new primary that accepts writes.
    """

    def __init__(self, group: SentinelGroup, timeline: Timeline, *, kill_at: float,
                 down_s: float, stall_at: float, stall_s: float) -> None:
        super().__init__(name="drill-sentinel-failovers", daemon=True)
        self.group = group
        self.timeline = timeline
        self.kill_at, self.down_s = kill_at, down_s
        self.stall_at, self.stall_s = stall_at, stall_s
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        self.failover_s: dict[str, float] = {}
        #: Per fault, how many bytes of the primary's writes the most up-to-date replica
        #: lacked just before it (read from INFO a moment before the signal): what a
        #: failover without WAIT would have lost had it struck then.
        self.lag_bytes: dict[str, int | None] = {}

    def run(self) -> None:
        try:
            if self.cancelled.wait(max(self.kill_at - time.time(), 0)):
                return
            lag = self._replication_lag()
            killed = self.group.kill_primary()
            down = self.timeline.note("primary-kill", f"port {killed.port}")
            self.lag_bytes["kill"] = lag
            self._promoted("kill", killed.port, down.at)
            time.sleep(max(down.at + self.down_s - time.time(), 0))
            killed.start()
            self.timeline.note("old-primary-start", f"port {killed.port}")
            if self.cancelled.wait(max(self.stall_at - time.time(), 0)):
                return
            self.lag_bytes["stall"] = self._replication_lag()
            stalled = self.group.pause_primary()
            stop = self.timeline.note("primary-stall", f"port {stalled.port}, SIGSTOP")
            self._promoted("stall", stalled.port, stop.at)
            time.sleep(max(stop.at + self.stall_s - time.time(), 0))
            self.group.resume(stalled)
            self.timeline.note("primary-resume", f"port {stalled.port}, SIGCONT")
        except BaseException as exc:
            self.error = exc
            self.timeline.note("failover-error", repr(exc))

    def _replication_lag(self) -> int | None:
        """Bytes of the primary's replication stream its best replica has not acknowledged."""
        try:
            with self.group.client(self.group.primary) as client:
                info = client.info("replication")
        except (redis.RedisError, RuntimeError):
            return None
        offsets = [int(v["offset"]) for k, v in info.items()
                   if k.startswith("slave") and isinstance(v, dict) and "offset" in v]
        return int(info["master_repl_offset"]) - max(offsets) if offsets else None

    def _promoted(self, fault: str, old_port: int, since: float) -> None:
        new = self.group.wait_for_new_primary(old_port)
        self.failover_s[fault] = round(time.time() - since, 2)
        self.timeline.note("new-primary", f"port {new.port}, {self.failover_s[fault]} s "
                                          f"after the {fault}")

    def finish(self) -> None:
        """Wait for the faults to be over (or cancel those not begun)."""
        self.cancelled.set()
        self.join(timeout=90)
        for node in self.group.nodes:  # never leave a node stopped
            if node.is_running():
                self.group.resume(node)
