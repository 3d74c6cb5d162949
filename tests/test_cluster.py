"""``envelope-cluster://`` end to end: a Redis Cluster of three primaries with one replica
each (real redis-server processes on loopback) and a real prefork Celery worker, with
Celery's defaults, consuming two queues that live on two different shards.

Each queue is its own slot (the hash tag ``{<queue>}``), so the worker keeps one
blocking read per queue, each on the node that owns the queue's slot. The module
checks a publish_many spread over the shards, immediate and delayed tasks (the
worker's promoter moves them), a dead letter, a cancel and a revoke; then, while
tasks are published, a resharding of a busy queue's slot to the third primary and
a SIGKILL of one primary (its replica takes over). Task records and worker
announcements are read back from their queues' slots. The worker never exits, and no
task with an idempotency key has its effect twice; what the SIGKILL lost (writes
the replica had not copied yet) is counted and reported.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from apps.cluster_app import EFFECTS, STARTS, create_app
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from support.workers import CeleryWorker

import kombu_envelope
from kombu_envelope import Envelope, Publisher
from kombu_envelope.codec import decode_entry
from kombu_envelope.dispatcher.metrics import render
from kombu_envelope.envelope import PRIORITY_DEFAULT
from kombu_envelope.keys import Bucket, bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store import replication
from kombu_envelope.store.announcements import Announcements
from kombu_envelope.store.client import AnyRedis, client_for_url, close_client
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.delayed import CancelOutcome, DelayedTasks
from kombu_envelope.store.task_records import TaskRecords, TaskState
from kombu_envelope.store.worker_stats import StatsBuffer, read_stats
from kombu_envelope.testing.cluster import PrivateRedisCluster
from kombu_envelope.testing.redis_server import PrivateRedisServer

LUA_DIR = Path(kombu_envelope.__file__).resolve().parent / "lua"

LEASE_MS = 3000
EFFECT_TIMEOUT_S = 30.0

pytestmark = pytest.mark.timeout(120)


@dataclass
class Setup:
    cluster: PrivateRedisCluster
    ledger: redis.Redis
    client: AnyRedis
    app: Celery
    prefix: str
    worker: CeleryWorker
    #: Two queues whose slots are on two different primaries.
    queues: tuple[str, str]

    @property
    def settings(self) -> Settings:
        return Settings(key_prefix=self.prefix)

    def publish(self, queue: str, name: str, countdown: float | None = None) -> str:
        """Publish ``cluster.record`` of order ``<queue>:<name>`` to ``queue``."""
        task_id = uuid.uuid4().hex
        order_id = f"{queue}:{name}"
        self.app.tasks["cluster.record"].apply_async(
            kwargs={"order_id": order_id}, queue=queue, countdown=countdown, task_id=task_id,
            retry=True, retry_policy={"max_retries": 30, "interval_start": 0,
                                      "interval_step": 0.5, "interval_max": 1.0})
        return task_id

    def effects(self) -> dict[str, int]:
        return {key.decode(): int(count) for key, count in self.ledger.hgetall(EFFECTS).items()}

    def wait_effects(self, expected: set[str], timeout: float = EFFECT_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not expected <= set(self.effects()):
            assert self.worker.is_alive(), self.worker.log_tail()
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.effects()))
                pytest.fail(f"no effect for {missing[:10]} ({len(missing)} in all)\n"
                            f"{self.worker.log_tail()}")
            time.sleep(0.1)


def _queues_on_two_shards(cluster: PrivateRedisCluster, prefix: str) -> tuple[str, str]:
    chosen: dict[int, str] = {}
    for number in range(100):
        queue = f"orders-{number}"
        owner = cluster.owner_of(cluster.keyslot(f"{prefix}:{{{queue}}}:normal"))
        chosen.setdefault(owner, queue)
        if len(chosen) == 2:
            first, second = chosen.values()
            return first, second
    raise AssertionError("no two queues on two shards among 100 names")


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    with PrivateRedisCluster() as cluster, PrivateRedisServer() as ledger_server:
        queues = _queues_on_two_shards(cluster, prefix)
        env = {"TEST_BROKER_URL": cluster.url, "TEST_KEY_PREFIX": prefix,
               "TEST_LEASE_MS": str(LEASE_MS), "TEST_LEDGER_URL": ledger_server.url}
        worker = CeleryWorker("apps.cluster_app", pool="prefork", concurrency=2,
                              queues=list(queues), env=env)
        app = create_app(cluster.url, prefix, LEASE_MS)
        client = client_for_url(cluster.url)
        ledger = redis.Redis.from_url(ledger_server.url)
        try:
            worker.start()
            yield Setup(cluster, ledger, client, app, prefix, worker, queues)
        finally:
            worker.close()
            app.close()
            close_client(client)
            ledger.close()


def test_the_two_queues_live_on_two_shards(setup: Setup) -> None:
    slots = [setup.cluster.keyslot(f"{setup.prefix}:{{{queue}}}:high") for queue in setup.queues]
    owners = {setup.cluster.owner_of(slot) for slot in slots}
    assert len(owners) == 2
    # Every key of a queue shares its slot: one step never crosses a slot.
    for queue, slot in zip(setup.queues, slots):
        keys = setup.settings.keys.queue(queue)
        assert {setup.cluster.keyslot(key) for key in (
            *keys.all_streams, keys.delayed, keys.delayed_data, keys.dead)} == {slot}


def test_publish_many_spreads_over_shards_and_loads_scripts_a_node_lost(setup: Setup) -> None:
    """One pipeline per node carries the scripts: a node that lost them (a failover to a
    replica that never loaded them, a restart) gets them again and the call is sent again."""
    cluster = setup.cluster
    for port in cluster.primaries():
        with closing(cluster.client(port)) as node:
            node.script_flush()
    names = [f"spread-{number}" for number in range(9)]
    assert len({cluster.owner_of(cluster.keyslot(f"{{{name}}}")) for name in names}) >= 2
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    items = [(name, Envelope.new(task_type="cluster.record", payload={"order_id": name},
                                 schedule_time=later if number % 3 == 0 else None))
             for number, name in enumerate(names)]
    replies = Publisher(setup.client, setup.settings).publish_many(items)
    assert [reply is None for reply in replies] == [n % 3 == 0 for n in range(len(names))]
    for (name, envelope), reply in zip(items, replies):
        keys = setup.settings.keys.queue(name)
        if reply is None:
            assert setup.client.zscore(keys.delayed, envelope.task_id) is not None
            assert setup.client.sismember(setup.settings.keys.queues, name)
        else:
            assert setup.client.xlen(keys.stream(bucket_for(envelope.priority))) == 1


def test_publish_iter_stores_each_queue_in_order_over_the_shards(setup: Setup) -> None:
    """Each chunk goes as one pipeline per node when it is full; a queue's entries keep the
    order they were drawn in, and a delayed task's queue is registered."""
    names = [f"iter-{number}" for number in range(4)]
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    items = [(names[n % 4], Envelope.new(task_type="cluster.record", payload={"n": n},
                                         schedule_time=later if n == 5 else None))
             for n in range(2_345)]
    replies = Publisher(setup.client, setup.settings).publish_iter(iter(items))
    assert [reply is None for reply in replies] == [n == 5 for n in range(len(items))]
    for name in names:
        keys = setup.settings.keys.queue(name)
        entries = setup.client.xrange(keys.stream(bucket_for(PRIORITY_DEFAULT)))
        assert [decode_entry(fields).payload["n"] for _, fields in entries] == [
            n for n, (queue, _) in enumerate(items) if queue == name and n != 5]
    assert setup.client.sismember(setup.settings.keys.queues, names[1])


def test_immediate_and_delayed_tasks_run_once_on_both_shards(setup: Setup) -> None:
    expected = set()
    published_at = time.time()
    for queue in setup.queues:
        for number in range(10):
            setup.publish(queue, f"now-{number}")
            expected.add(f"{queue}:now-{number}")
        for number in range(3):
            setup.publish(queue, f"later-{number}", countdown=1.5)
            expected.add(f"{queue}:later-{number}")
    setup.wait_effects(expected)
    effects = setup.effects()
    assert all(effects[key] == 1 for key in expected)
    starts = [entry.decode().split() for entry in setup.ledger.lrange(STARTS, 0, -1)]
    for name, started in starts:
        if ":later-" in name:
            assert float(started) >= published_at + 1.4, f"{name} started early"


def test_a_failed_task_is_dead_lettered_in_its_queue(setup: Setup) -> None:
    queue = setup.queues[1]
    task_id = uuid.uuid4().hex
    setup.app.tasks["cluster.fail"].apply_async(kwargs={"order_id": "bad"}, queue=queue,
                                               task_id=task_id)
    letters = DeadLetters(setup.client, setup.settings)
    deadline = time.monotonic() + EFFECT_TIMEOUT_S
    while not [e for e in letters.iter(queue) if e.task_id == task_id]:
        assert time.monotonic() < deadline, setup.worker.log_tail()
        time.sleep(0.1)
    assert queue in letters.queues()
    (entry,) = [e for e in letters.iter(queue) if e.task_id == task_id]
    assert entry.failure_class == "task_error"
    # Acknowledged early (prefork): written from the request, its record names the entry.
    record = TaskRecords(setup.client, setup.settings).get(task_id, queue)
    assert (record.state, record.dead_id) == (TaskState.DEAD, entry.entry_id)


def test_cancel_and_revoke_reach_delayed_tasks_on_any_shard(setup: Setup) -> None:
    first, second = setup.queues
    cancelled = setup.publish(first, "cancelled", countdown=2.0)
    revoked = setup.publish(second, "revoked", countdown=2.0)
    setup.publish(second, "kept", countdown=2.0)
    assert DelayedTasks(setup.client, setup.settings).cancel_everywhere(cancelled).outcome \
        is CancelOutcome.REMOVED
    setup.app.AsyncResult(revoked).revoke()
    setup.wait_effects({f"{second}:kept"})
    time.sleep(1.0)  # the promoter moved everything due by now
    effects = setup.effects()
    assert f"{first}:cancelled" not in effects
    assert f"{second}:revoked" not in effects


def test_task_records_and_announcements_live_in_each_queue_slot(setup: Setup) -> None:
    records = TaskRecords(setup.client, setup.settings)
    first, second = setup.queues
    now = datetime.now(timezone.utc)
    due, later = (Envelope.new(task_type="cluster.record", payload={"order_id": name},
                               schedule_time=when)
                  for name, when in (("rec-due", None), ("rec-later", now + timedelta(hours=1))))
    # publish_many: one script per Envelope, each with its record, sent per node.
    Publisher(setup.client, setup.settings).publish_many([(first, due), (second, later)])
    assert records.get(later.task_id).state is TaskState.SCHEDULED
    assert records.get(later.task_id, second).queue == second
    assert DelayedTasks(setup.client, setup.settings).cancel_everywhere(later.task_id).outcome \
        is CancelOutcome.REMOVED
    assert records.get(later.task_id).state is TaskState.CANCELLED
    setup.wait_effects({"rec-due"})
    deadline = time.monotonic() + EFFECT_TIMEOUT_S
    while (done := records.get(due.task_id, first)).state is not TaskState.SUCCEEDED:
        assert time.monotonic() < deadline, done
        time.sleep(0.05)
    assert done.attempts == 1 and done.language == "python" and done.worker
    assert setup.client.keyslot(records.record_key(first, due.task_id)) == \
        setup.client.keyslot(setup.settings.keys.queue(first).delayed)
    announcements = Announcements(setup.client, setup.settings)
    assert sorted(announcements.serving_queues("cluster.record", 1)) == sorted(setup.queues)
    (worker,) = announcements.workers(first)
    assert worker.live and worker.concurrency == 2 and worker.serves["cluster.fail"] == [1]


def test_worker_statistics_and_metrics_read_each_queue_slot(setup: Setup) -> None:
    buffer = StatsBuffer(setup.settings)
    for queue in setup.queues:  # one MULTI per queue, each on its own shard
        buffer.count(queue, "cluster.probe", "succeeded")
    assert buffer.flush(setup.client)
    for queue in setup.queues:
        (probe,) = [s for s in read_stats(setup.client, setup.settings, queue)
                    if s.task_type == "cluster.probe"]
        assert probe.counters["succeeded"] == 1
    second = setup.queues[1]
    setup.app.tasks["cluster.fail"].apply_async(kwargs={"order_id": "counted"}, queue=second)

    def samples() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        page = render(setup.client, setup.settings).decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(page) for s in family.samples}

    dead = ("kombu_envelope_tasks_dead_lettered_total", frozenset(
        {"queue": second, "task_type": "cluster.fail", "language": "python"}.items()))
    deadline = time.monotonic() + EFFECT_TIMEOUT_S
    while not samples().get(dead):
        assert time.monotonic() < deadline, setup.worker.log_tail()
        time.sleep(0.2)
    page = samples()
    for queue in setup.queues:
        assert page[("kombu_envelope_tasks_succeeded_total", frozenset(
            {"queue": queue, "task_type": "cluster.probe", "language": "python"}.items()))] == 1
        assert page[("kombu_envelope_workers", frozenset(
            {"queue": queue, "language": "python"}.items()))] == 1


def test_wait_replicas_waits_on_each_shard_for_its_own_replica(setup: Setup) -> None:
    """``wait_replicas`` on a Cluster: a publish returns once the replica of its queue's
    shard holds it, and a stalled replica delays (and is counted for) only its shard."""
    cluster, (first, second) = setup.cluster, setup.queues
    settings = Settings(key_prefix=setup.prefix, wait_replicas=1, wait_timeout_ms=1000)
    client = client_for_url(cluster.url, settings)
    publisher = Publisher(client, settings)
    later = datetime.now(timezone.utc) + timedelta(hours=1)

    def replica_of(queue: str) -> redis.Redis:
        primary = cluster.owner_of(cluster.keyslot(f"{setup.prefix}:{{{queue}}}:normal"))
        (port,) = cluster.replicas_of(primary)
        return cluster.client(port)

    try:
        items = [(queue, Envelope.new(task_type="cluster.record", payload={"order_id": queue},
                                      schedule_time=later)) for queue in (first, second)]
        before = replication.short_waits()
        publisher.publish_many(items)
        for queue, envelope in items:  # on the replica the moment the call returned
            with closing(replica_of(queue)) as replica:
                replica.execute_command("READONLY")
                assert replica.zscore(setup.settings.keys.queue(queue).delayed,
                                      envelope.task_id) is not None
        assert replication.short_waits() == before

        stalled = replica_of(second)
        stalled_port = stalled.connection_pool.connection_kwargs["port"]
        stalled.close()
        cluster.pause(stalled_port)
        try:
            publisher.publish(first, Envelope.new(task_type="cluster.record",
                                                  payload={"order_id": first},
                                                  schedule_time=later))
            assert replication.short_waits() == before  # the other shard's replica answers
            started = time.monotonic()
            publisher.publish(second, Envelope.new(task_type="cluster.record",
                                                   payload={"order_id": second},
                                                   schedule_time=later))
            assert time.monotonic() - started >= 0.9
        finally:
            cluster.resume(stalled_port)
        assert replication.short_waits() == before + 1
        cluster.wait_ok()
    finally:
        close_client(client)


def test_resharding_a_busy_queue_keeps_the_worker_consuming(setup: Setup) -> None:
    queue = setup.queues[0]
    cluster = setup.cluster
    slot = cluster.keyslot(f"{setup.prefix}:{{{queue}}}:normal")
    source = cluster.owner_of(slot)
    target = next(port for port in cluster.primaries() if port != source
                  and port != cluster.owner_of(cluster.keyslot(
                      f"{setup.prefix}:{{{setup.queues[1]}}}:normal")))
    expected = set()
    for number in range(60):
        setup.publish(queue, f"reshard-{number}", countdown=0.5 if number % 5 == 0 else None)
        expected.add(f"{queue}:reshard-{number}")
        if number == 20:
            cluster.move_slot(slot, to=target)
    assert cluster.owner_of(slot) == target
    setup.wait_effects(expected)
    effects = setup.effects()
    assert [key for key in expected if effects[key] != 1] == []
    assert setup.worker.is_alive()
    # The read blocked on the old owner was redirected, and read again from the new one.
    assert f"blocking read of {queue} lost its node" in setup.worker.log_text()


def test_sigkill_of_a_primary_while_publishing_duplicates_nothing(setup: Setup) -> None:
    """No WAIT: writes the replica had not copied when its primary died are lost with
    it (docs/operations.md gives the window); idempotency keys keep any redelivery
    from running an effect twice, and the worker rides the failover out."""
    queue = setup.queues[1]
    cluster = setup.cluster
    victim = cluster.owner_of(cluster.keyslot(f"{setup.prefix}:{{{queue}}}:normal"))
    published: list[str] = []
    killed_at = recovered_at = 0.0
    for number in range(80):
        setup.publish(queue, f"kill-{number}", countdown=1.0 if number % 4 == 0 else None)
        published.append(f"{queue}:kill-{number}")
        if number == 30:
            killed_at = time.monotonic()
            cluster.kill(victim)
            recovered_at = time.monotonic()
        time.sleep(0.02)
    deadline = time.monotonic() + EFFECT_TIMEOUT_S
    while time.monotonic() < deadline and not set(published) <= set(setup.effects()):
        time.sleep(0.2)
    effects = setup.effects()
    lost = [key for key in published if key not in effects]
    print(f"primary SIGKILL: replica serving after {recovered_at - killed_at:.1f} s; "
          f"{len(lost)} of {len(published)} tasks lost with the primary: {lost}")
    assert setup.worker.is_alive(), setup.worker.log_tail()
    assert f"blocking read of {queue} lost its node" in setup.worker.log_text()
    assert [key for key in published if effects.get(key, 0) > 1] == []
    # The loss window is the replication lag at the kill: a few writes at most.
    assert len(lost) <= 5, lost


def test_read_lua_while_a_slot_migrates(setup: Setup) -> None:
    """read.lua touches limit keys it cannot declare (docs/protocol.md, section 19). While
    the queue's slot migrates, on the source (the limit keys missing there) and on the
    importing node (ASKING, the streams moved there, the limit keys not), it must not fail:
    a queue without limits reads on, and a limited one never hands out more than its cap."""
    cluster, prefix = setup.cluster, setup.prefix
    body = '{"task_type": "slow"}'
    script = (LUA_DIR / "read.lua").read_text(encoding="utf-8")

    def read_while_importing(limits: str | None, on_source: bool = False) -> list:
        """read.lua's answer while the slot migrates, two tasks published: on the importing
        node (ASKING) once the streams moved there, or on the source before they did."""
        keys = Settings(key_prefix=prefix).keys.queue(f"importing-{uuid.uuid4().hex[:6]}")
        slot = cluster.keyslot(keys.limits)
        source = cluster.owner_of(slot)
        target = next(port for port in cluster.primaries() if port != source)
        nodes = {node.port: node.node_id for node in cluster.nodes()}
        streams = list(keys.task_streams)
        moved = [*streams, *([keys.limits] if limits else [])]
        with closing(cluster.client(source)) as node, closing(cluster.client(target)) as other:
            for stream in streams:
                node.xgroup_create(stream, "workers", "0", mkstream=True)
            for _ in range(2):
                node.xadd(keys.stream(Bucket.NORMAL), {"v": "1", "enc": "json", "body": body})
            if limits is not None:
                node.hset(keys.limits, "slow", limits)
            other.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", nodes[source])
            node.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", nodes[target])
            if on_source:
                answer = node.eval(script, len(streams), *streams, "workers", "c-1", 10, 30_000)
            else:
                node.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *moved)
                pipe = other.pipeline(transaction=False)  # one connection: ASKING, the script
                pipe.execute_command("ASKING")
                pipe.eval(script, len(streams), *streams, "workers", "c-1", 10, 30_000)
                answer = pipe.execute()[1]
        cluster.move_slot(slot, to=target)
        return answer

    for on_source in (True, False):
        reply, *_rest = read_while_importing(None, on_source)
        assert sum(len(entries) for _stream, entries in reply) == 2
        reply, _wait_ms, limited, _freed = read_while_importing('{"concurrency": 1}', on_source)
        assert sum(len(entries) for _stream, entries in reply) <= 1 and limited == 1
