"""The Cluster scenario: queues spread over a three-shard Redis Cluster against one Redis.

Opt-in (``python -m bench --scenarios cluster``): it starts its own Cluster of three
primaries with one replica each (:class:`~kombu_envelope.testing.cluster.PrivateRedisCluster`)
next to the run's private Redis, and measures both in one run, on the same queues:

* bulk publish: N Envelopes spread round robin over ``queues`` queues with
  ``Publisher.publish_many`` (one pipeline per node on the Cluster);
* consume+ack: one kombu consumer of every queue (prefetch 100) drains them; it keeps
  one blocking read per queue, each on the node that owns the queue's slot;
* publish-to-start: Envelopes published one by one at a fixed rate, round robin over
  the queues, to a consumer process of every queue.
"""

from __future__ import annotations

import itertools
from contextlib import closing
from time import perf_counter
from typing import Any

from kombu import Consumer, Exchange, Queue

from bench.core import ENVELOPE, Context, ScenarioResult, new_run_id
from bench.kombu_level import ACCEPT, PREFETCH, connect, new_envelope, publish_to_start
from bench.stats import Measure, percentile
from kombu_envelope import Publisher, Settings
from kombu_envelope.store.client import client_for_url, close_client
from kombu_envelope.testing.cluster import PrivateRedisCluster

#: Envelopes per publish_many call.
CHUNK = 1000


def spread_queues(cluster: PrivateRedisCluster, count: int, prefix: str) -> list[str]:
    """``count`` queue names, as many on each shard of ``cluster`` as can be."""
    primaries = cluster.primaries()
    by_owner: dict[int, list[str]] = {port: [] for port in primaries}
    for number in itertools.count():
        name = f"{prefix}.{number}"
        owner = cluster.owner_of(cluster.keyslot(f"{{{name}}}"))
        if len(by_owner[owner]) < -(-count // len(primaries)):
            by_owner[owner].append(name)
        names = [q for queues in by_owner.values() for q in queues]
        if len(names) >= count:
            return names[:count]
    raise AssertionError("unreachable")


def _bench_queues(names: list[str]) -> list[Queue]:
    return [Queue(name, Exchange(name, type="direct", durable=True), routing_key=name,
                  durable=True) for name in names]


def _throughput(url: str, names: list[str], n: int) -> tuple[float, float]:
    """(publish_many Envelopes/s, consume+ack msgs/s) of ``n`` Envelopes over ``names``."""
    queues = _bench_queues(names)
    with connect(url) as conn:
        for queue in queues:
            queue(conn.default_channel).declare()
        client = client_for_url(url)
        try:
            publisher = Publisher(client, Settings())
            items = [(names[i % len(names)], new_envelope()) for i in range(n)]
            started = perf_counter()
            for start in range(0, n, CHUNK):
                publisher.publish_many(items[start:start + CHUNK])
            publish_rate = n / (perf_counter() - started)
        finally:
            close_client(client)
        received = 0

        def on_message(_body: Any, message: Any) -> None:
            nonlocal received
            message.ack()
            received += 1

        with closing(conn.channel()) as channel:
            channel.basic_qos(0, PREFETCH, False)
            with Consumer(channel, queues=queues, callbacks=[on_message], accept=ACCEPT):
                started = perf_counter()
                while received < n:
                    conn.drain_events(timeout=30)
                consume_rate = n / (perf_counter() - started)
    return publish_rate, consume_rate


def run_cluster(ctx: Context, result: ScenarioResult) -> None:
    """Throughput and publish-to-start latency, one Redis against a three-shard Cluster."""
    n = ctx.size("cluster", "n")
    count = ctx.size("cluster", "queues")
    rate = ctx.real("cluster", "rate")
    seconds = ctx.real("cluster", "seconds")
    result.params.update(envelopes=n, queues=count, shards=3, replicas_per_shard=1,
                         rate_per_s=rate, seconds=seconds, prefetch=PREFETCH)
    with PrivateRedisCluster() as cluster:
        targets = {"one Redis": f"envelope://{ctx.hostport}", "Cluster": cluster.url}
        table: dict[tuple[str, str], Measure] = {}
        for label in targets:
            for what, unit, higher in (("bulk publish", "Envelopes/s", True),
                                       ("consume+ack", "msgs/s", True),
                                       ("publish-to-start p50", "ms", False),
                                       ("publish-to-start p99", "ms", False)):
                table[label, what] = result.measure(f"{what} {label}", ENVELOPE, unit,
                                                    higher_is_better=higher)
        for rep in range(ctx.repeat):
            names = spread_queues(cluster, count, f"bench.cluster.{new_run_id()}")
            for label, url in targets.items():
                publish_rate, consume_rate = _throughput(url, names, n)
                latencies = publish_to_start(url, _bench_queues(names), "envelope", rate,
                                             seconds)
                table[label, "bulk publish"].add(publish_rate)
                table[label, "consume+ack"].add(consume_rate)
                table[label, "publish-to-start p50"].add(percentile(latencies, 50))
                table[label, "publish-to-start p99"].add(percentile(latencies, 99))
                ctx.log(f"cluster rep {rep + 1}: {label}: publish {publish_rate:,.0f}/s, "
                        f"consume+ack {consume_rate:,.0f}/s, publish-to-start p50 "
                        f"{percentile(latencies, 50):.2f} ms p99 "
                        f"{percentile(latencies, 99):.2f} ms")
            ctx.flush()
    for what in ("bulk publish", "consume+ack", "publish-to-start p50"):
        result.ratio(f"{what}: Cluster / one Redis", table["Cluster", what],
                     table["one Redis", what])
    result.notes.append(
        "Both run on this machine: the Cluster's six redis-server processes share its cores "
        "with the client, so the figures show the client-side cost of the spread (one "
        "pipeline per node, one blocking read per queue), not the capacity three hosts add.")
