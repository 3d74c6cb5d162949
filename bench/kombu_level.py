"""kombu-level scenarios: publish throughput, consume+ack throughput, latency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from kombu import Connection, Consumer, Exchange, Producer, Queue

import kombu_envelope.kombu.adapter  # noqa: F401  (registers envelope:// and the envelope serializer)
from bench.core import AMQP, ENVELOPE, STOCK, Context, ScenarioResult, new_run_id, paced
from bench.payload import PAYLOAD, TASK_TYPE, payload_bytes
from bench.stats import Measure, percentile
from bench.workers import ROOT
from kombu_envelope import Envelope, Publisher, Settings

#: kombu-level scenarios use the plain transport: once ``celery_ext`` is imported
#: (the Celery scenarios need it), ``envelope://`` means its Celery-aware subclass.
PLAIN_TRANSPORT = "kombu_envelope.kombu.transport:Transport"
#: Content types consumers accept: plain JSON and Envelopes.
ACCEPT = ["json", "envelope"]
#: Prefetch of the consume scenario (``basic_qos`` prefetch_count).
PREFETCH = 100
#: Messages published before timing starts (connections, scripts, bindings).
WARMUP = 50


@dataclass(frozen=True)
class Variant:
    """One transport and one kind of body."""

    transport: str
    kind: str  # "envelope" (Envelope tasks) or "json" (plain JSON messages)
    label: str
    #: Transport options of its connection, as (name, value) pairs.
    options: tuple[tuple[str, Any], ...] = ()


ENVELOPE_TASKS = Variant(ENVELOPE, "envelope", "envelope://, Envelope tasks")
#: The same without task records (docs/protocol.md, section 14): what they cost.
ENVELOPE_TASKS_NO_RECORDS = Variant(ENVELOPE, "envelope",
                                    "envelope://, Envelope tasks, task records off",
                                    (("task_record_retention_s", 0),))
ENVELOPE_JSON = Variant(ENVELOPE, "json", "envelope://, plain JSON")
STOCK_JSON = Variant(STOCK, "json", "redis:// (stock), plain JSON")
AMQP_JSON = Variant(AMQP, "json", "pyamqp:// (RabbitMQ), plain JSON")


def variants(ctx: Context) -> list[Variant]:
    """The variants this run measures (RabbitMQ only when it is reachable)."""
    found = [ENVELOPE_TASKS, ENVELOPE_JSON, STOCK_JSON]
    if ctx.amqp_url:
        found.append(AMQP_JSON)
    return found


def new_envelope(payload: dict[str, Any] | None = None) -> Envelope:
    """An Envelope task carrying ``payload`` (default :data:`PAYLOAD`)."""
    return Envelope.new(task_type=TASK_TYPE, payload=PAYLOAD if payload is None else payload)


def connect(url: str, options: tuple[tuple[str, Any], ...] = ()) -> Connection:
    """A kombu connection with transport ``options``; ``envelope://`` URLs get the plain
    kombu-envelope transport."""
    return Connection(url, transport=PLAIN_TRANSPORT if url.startswith("envelope") else None,
                      transport_options=dict(options))


@contextmanager
def bench_queue(ctx: Context, transport: str, prefix: str,
                options: tuple[tuple[str, Any], ...] = ()) -> Iterator[tuple[Connection, Queue]]:
    """A connection (with transport ``options``) and a fresh declared queue (bound like
    Celery binds its queues)."""
    name = f"{prefix}.{new_run_id()}"
    exchange = Exchange(name, type="direct", durable=True)
    queue = Queue(name, exchange, routing_key=name, durable=True)
    with connect(ctx.url(transport), options) as conn:
        queue(conn.default_channel).declare()
        try:
            yield conn, queue
        finally:
            if transport == AMQP:
                queue(conn.default_channel).delete()
    if transport != AMQP:
        ctx.flush()


def publish_fn(producer: Producer, queue: Queue, kind: str,
               prebuilt: bool = False) -> Callable[[Any], None]:
    """A function publishing one body of ``kind`` to ``queue``."""
    exchange, key = queue.exchange, queue.routing_key

    if kind == "envelope":
        def publish_envelope(body: Any = None) -> None:
            producer.publish(body if prebuilt else new_envelope(), serializer="envelope",
                             exchange=exchange, routing_key=key)
        return publish_envelope

    def publish_json(body: Any = None) -> None:
        producer.publish(PAYLOAD if body is None else body, serializer="json",
                         exchange=exchange, routing_key=key)
    return publish_json


# ------------------------------------------------------------------ 1. publish


def run_publish(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 1: one producer publishes N messages, one at a time."""
    n = ctx.size("publish", "n")
    result.params.update(messages=n, warmup=WARMUP, payload_bytes=payload_bytes())
    chosen = variants(ctx)
    chosen.insert(1, ENVELOPE_TASKS_NO_RECORDS)
    measures = {v: result.measure(f"publish {v.label}", v.transport, "msgs/s")
                for v in chosen}
    for rep in range(ctx.repeat):
        for variant in chosen:
            with bench_queue(ctx, variant.transport, "bench.publish",
                             variant.options) as (conn, queue):
                publish = publish_fn(conn.Producer(), queue, variant.kind)
                for _ in range(WARMUP):
                    publish(None)
                started = perf_counter()
                for _ in range(n):
                    publish(None)
                rate = n / (perf_counter() - started)
            measures[variant].add(rate)
            ctx.log(f"publish rep {rep + 1}: {variant.label}: {rate:,.0f} msgs/s")
    ratio = result.ratio("envelope Envelope tasks / stock JSON", measures[ENVELOPE_TASKS],
                         measures[STOCK_JSON])
    result.ratio("envelope plain JSON / stock JSON", measures[ENVELOPE_JSON],
                 measures[STOCK_JSON])
    result.ratio("Envelope tasks, task records on / off", measures[ENVELOPE_TASKS],
                 measures[ENVELOPE_TASKS_NO_RECORDS])
    result.target("kombu publish, Envelope tasks >= 1.5x stock", ratio, 1.5, unit="x")
    result.notes.append(
        "The Envelope variant builds each Envelope (`Envelope.new`, validated) inside the "
        "timed loop and publishes it with `serializer=\"envelope\"`: that is what publishing "
        "a task costs. Plain JSON on envelope:// goes to the queue's `kombu` stream. "
        "`task records off` sets `task_record_retention_s=0`: no record is written.")


# ------------------------------------------------------------------ 2. consume


def prepublish(ctx: Context, conn: Connection, queue: Queue, variant: Variant, n: int) -> None:
    """Put ``n`` messages in ``queue`` quickly, byte for byte as kombu would publish them."""
    client = ctx.client()
    try:
        if variant.kind == "envelope":
            publisher = Publisher(client, Settings())
            for start in range(0, n, 1000):
                publisher.publish_many(
                    [(queue.name, new_envelope()) for _ in range(min(1000, n - start))])
            return
        producer = conn.Producer()
        publish = publish_fn(producer, queue, variant.kind)
        if variant.transport == AMQP:
            for _ in range(n):
                publish(None)
            return
        publish(None)
        pipe = client.pipeline(transaction=False)
        if variant.transport == STOCK:
            template = json.loads(client.lindex(queue.name, 0))
            for index in range(n - 1):
                template["properties"]["delivery_tag"] = str(uuid.uuid4())
                pipe.lpush(queue.name, json.dumps(template))
                if index % 1000 == 999:
                    pipe.execute()
        else:
            stream = Settings().keys.queue(queue.name).kombu_stream
            (_entry_id, fields), = client.xrange(stream, count=1)
            for index in range(n - 1):
                pipe.xadd(stream, fields)
                if index % 1000 == 999:
                    pipe.execute()
        pipe.execute()
    finally:
        client.close()


def drain(conn: Connection, queue: Queue, n: int, timeout: float = 30.0) -> float:
    """Consume and ack ``n`` messages with prefetch :data:`PREFETCH`; return seconds taken."""
    received = 0

    def on_message(_body: Any, message: Any) -> None:
        nonlocal received
        message.ack()
        received += 1

    channel = conn.channel()
    channel.basic_qos(0, PREFETCH, False)
    with Consumer(channel, queues=[queue], callbacks=[on_message], accept=ACCEPT):
        started = perf_counter()
        while received < n:
            conn.drain_events(timeout=timeout)
        return perf_counter() - started


def run_consume(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 2: drain N pre-published messages, acking each, prefetch 100."""
    n = ctx.size("consume", "n")
    result.params.update(messages=n, prefetch_count=PREFETCH)
    chosen = variants(ctx)
    measures = {v: result.measure(f"consume+ack {v.label}", v.transport, "msgs/s")
                for v in chosen}
    for rep in range(ctx.repeat):
        for variant in chosen:
            with bench_queue(ctx, variant.transport, "bench.consume") as (conn, queue):
                prepublish(ctx, conn, queue, variant, n)
                rate = n / drain(conn, queue, n)
            measures[variant].add(rate)
            ctx.log(f"consume rep {rep + 1}: {variant.label}: {rate:,.0f} msgs/s")
    ratio = result.ratio("envelope Envelope tasks / stock JSON", measures[ENVELOPE_TASKS],
                         measures[STOCK_JSON])
    result.ratio("envelope plain JSON / stock JSON", measures[ENVELOPE_JSON],
                 measures[STOCK_JSON])
    result.target("kombu consume+ack, Envelope tasks >= 1.5x stock", ratio, 1.5, unit="x")
    result.notes.append(
        "Messages are put in the queue before timing (Envelopes with `Publisher.publish_many`, "
        "stock messages as kombu stores them); the clock runs from the first `drain_events` "
        "to the N-th ack. Each callback acks its message at once.")


# ------------------------------------------------------------------ 5. latency


def _round_trips(ctx: Context, variant: Variant, n: int) -> list[float]:
    """Milliseconds taken by each of ``n`` single publishes (pre-built bodies)."""
    with bench_queue(ctx, variant.transport, "bench.rtt") as (conn, queue):
        publish = publish_fn(conn.Producer(), queue, variant.kind, prebuilt=True)
        bodies: list[Any] = ([new_envelope() for _ in range(n + WARMUP)]
                             if variant.kind == "envelope" else [PAYLOAD] * (n + WARMUP))
        for body in bodies[:WARMUP]:
            publish(body)
        times = []
        for body in bodies[WARMUP:]:
            started = perf_counter()
            publish(body)
            times.append((perf_counter() - started) * 1000)
    return times


def _publish_to_start(ctx: Context, variant: Variant, rate: float, seconds: float
                      ) -> list[float]:
    """Publish at ``rate`` msgs/s for ``seconds``; return each message's latency (ms)."""
    with bench_queue(ctx, variant.transport, "bench.latency") as (_conn, queue):
        return publish_to_start(ctx.url(variant.transport), [queue], variant.kind, rate,
                                seconds)


def publish_to_start(url: str, queues: list[Queue], kind: str, rate: float, seconds: float
                     ) -> list[float]:
    """Publish at ``rate`` msgs/s for ``seconds``, round robin over ``queues`` (declared),
    to a consumer process of all of them; return each message's latency (ms)."""
    count = max(int(rate * seconds), 1)
    consumer = subprocess.Popen(
        [sys.executable, "-m", "bench.consumer", "--url", url,
         *(arg for queue in queues for arg in ("--queue", queue.name)),
         "--count", str(count), "--kind", kind],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert consumer.stdout is not None
        if consumer.stdout.readline().strip() != "READY":
            raise RuntimeError("latency consumer did not start")
        time.sleep(0.3)
        with connect(url) as conn:
            producer = conn.Producer()
            publishers = [publish_fn(producer, queue, kind, prebuilt=True) for queue in queues]
            for index in paced(rate, count):
                payload = {**PAYLOAD, "sent_at": time.time()}
                publishers[index % len(publishers)](
                    new_envelope(payload) if kind == "envelope" else payload)
        out, _ = consumer.communicate(timeout=60)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    latencies: list[float] = json.loads(out.strip().splitlines()[-1])["latencies_ms"]
    if len(latencies) < count:
        raise RuntimeError(f"consumer saw {len(latencies)} of {count} messages")
    return latencies


def run_latency(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 5: single-publish round trip, and publish-to-start at a fixed rate."""
    n = ctx.size("latency", "round_trips")
    rate = ctx.real("latency", "rate")
    seconds = ctx.real("latency", "seconds")
    result.params.update(round_trips=n, rate_per_s=rate, seconds=seconds,
                         consumer_prefetch=PREFETCH)
    chosen = [v for v in variants(ctx) if v is not ENVELOPE_JSON]
    table: dict[tuple[Variant, str], Measure] = {}
    for variant in chosen:
        for what in ("publish round trip", "publish-to-start"):
            for pct in ("p50", "p99"):
                table[variant, f"{what} {pct}"] = result.measure(
                    f"{what} {pct} {variant.label}", variant.transport, "ms",
                    higher_is_better=False)
    for rep in range(ctx.repeat):
        for variant in chosen:
            rtt = _round_trips(ctx, variant, n)
            e2e = _publish_to_start(ctx, variant, rate, seconds)
            for what, values in (("publish round trip", rtt), ("publish-to-start", e2e)):
                table[variant, f"{what} p50"].add(percentile(values, 50))
                table[variant, f"{what} p99"].add(percentile(values, 99))
            ctx.log(f"latency rep {rep + 1}: {variant.label}: round trip p50 "
                    f"{percentile(rtt, 50):.3f} ms p99 {percentile(rtt, 99):.3f} ms; "
                    f"publish-to-start p50 {percentile(e2e, 50):.2f} ms "
                    f"p99 {percentile(e2e, 99):.2f} ms")
    for what in ("publish round trip p50", "publish round trip p99",
                 "publish-to-start p50", "publish-to-start p99"):
        result.ratio(f"{what}: envelope / stock", table[ENVELOPE_TASKS, what],
                     table[STOCK_JSON, what])
    result.notes.append(
        "Round trip: one `producer.publish()` call with a pre-built body, nothing consuming. "
        "Publish-to-start: a kombu consumer in its own process (prefetch 100) notes when its "
        "callback starts; the message carries its send time (same clock). The Envelope is "
        "built inside the measured interval.")
