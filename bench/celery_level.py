"""Celery scenarios: end to end, countdown tasks, memory per task, recovery after a crash;
and the helpers every Celery scenario shares."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import redis
from celery import Celery
from kombu import Connection, Queue

import celery_ext  # noqa: F401  (makes envelope:// the Celery-aware transport)
from bench.celery_app import run_key
from bench.core import (
    AMQP,
    ENVELOPE,
    PLUS,
    STOCK,
    Context,
    RedisClient,
    ScenarioResult,
    new_run_id,
)
from bench.cpu import CpuClock, broker_cpu, cpu_note, process_tree_s, this_process_s
from bench.payload import PAYLOAD, payload_bytes
from bench.plus import eta_property
from bench.stats import Measure
from bench.workers import Worker
from kombu_envelope import Settings
from kombu_envelope.envelope import PRIORITY_DEFAULT
from kombu_envelope.keys import bucket_for

LABELS = {ENVELOPE: "envelope://", STOCK: "redis:// (stock)",
          PLUS: "valkey:// (celery-redis-plus)", AMQP: "pyamqp:// (RabbitMQ)"}
#: Each transport's name in ratio labels ("envelope / stock").
SHORT = {STOCK: "stock", PLUS: "celery-redis-plus", AMQP: "RabbitMQ"}
MIB = 1024 * 1024
#: celery-redis-plus keys: a hash per message, a sorted set of every message of a queue
#: (``messages_index:<queue>``, scored with when it is due or to be restored).
PLUS_MESSAGE = "message:"
PLUS_INDEX = "messages_index:"


def publisher_app(broker_url: str, queue: str,
                  transport_options: dict[str, Any] | None = None) -> tuple[Celery, Any]:
    """A Celery app publishing to ``queue``, and its ``bench.noop`` task."""
    app = Celery("bench-publisher", broker=broker_url, set_as_current=False)
    app.conf.update(task_ignore_result=True, result_backend=None, task_default_queue=queue,
                    broker_transport_options=transport_options or {})

    @app.task(name="bench.noop", ignore_result=True, shared=False)
    def noop(run: str, total: int, data: dict[str, Any] | None = None) -> None:
        """Signature twin of :func:`bench.celery_app.noop` (runs in the workers)."""

    return app, noop


def redis_transports(ctx: Context) -> list[str]:
    """The Redis-backed brokers: envelope://, stock redis:// and celery-redis-plus if loaded."""
    return [t for t in ctx.celery_transports() if t != AMQP]


def apply_many(app: Celery, task: Any, count: int, kwargs: Callable[[int], dict[str, Any]],
               clock: CpuClock | None = None, **options: Any) -> tuple[float, dict[str, float]]:
    """``task.apply_async`` ``count`` times on one producer; return tasks/s and the µs of
    CPU per task of ``clock``'s sources (none without a clock)."""
    clock = clock or CpuClock({})
    with app.producer_or_acquire() as producer:
        before = clock.read()
        started = perf_counter()
        for index in range(count):
            task.apply_async(kwargs=kwargs(index), producer=producer, **options)
        rate = count / (perf_counter() - started)
        return rate, clock.per_task_us(before, clock.read(), count)


def cleanup(ctx: Context, transport: str, queue: str) -> None:
    """Remove what a repetition left behind."""
    if transport == AMQP:
        with Connection(ctx.url(AMQP)) as conn:
            Queue(queue).bind(conn.default_channel).delete()
    ctx.flush()


def task_stream(queue: str) -> str:
    """The envelope stream Celery tasks of default priority go to."""
    return Settings().keys.queue(queue).stream(bucket_for(PRIORITY_DEFAULT))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str,
             worker: Worker | None = None, step: float = 0.02) -> None:
    """Poll ``predicate`` until it holds; raise after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if worker is not None:
            worker.check_alive()
        if time.monotonic() > deadline:
            tail = f"\n{worker.log_tail()}" if worker is not None else ""
            raise RuntimeError(f"timed out waiting for {what}{tail}")
        time.sleep(step)


@contextmanager
def recording_client(ctx: Context) -> Iterator[RedisClient]:
    """A client on the private Redis, closed afterwards."""
    client = ctx.client()
    try:
        yield client
    finally:
        client.close()


def per_transport(result: ScenarioResult, transports: list[str], label: str, unit: str,
                  higher_is_better: bool = True) -> dict[str, Measure]:
    """One measure ``<label>, <transport>`` for every transport."""
    return {t: result.measure(f"{label}, {LABELS[t]}", t, unit, higher_is_better)
            for t in transports}


def cpu_measures(result: ScenarioResult, transports: list[str], what: str,
                 sources: tuple[str, ...]) -> dict[str, dict[str, Measure]]:
    """µs-per-task measures of ``what``, per CPU source (as :class:`bench.cpu.CpuClock`
    names them) and transport."""
    return {source: per_transport(result, transports, f"{what}: {source} CPU per task",
                                  "µs", higher_is_better=False)
            for source in sources}


def add_cpu(measures: dict[str, dict[str, Measure]], transport: str,
            per_task: dict[str, float]) -> None:
    """Record one repetition's µs per task of every source for ``transport``."""
    for source, by_transport in measures.items():
        by_transport[transport].add(per_task[source])


def cpu_ratios(result: ScenarioResult, what: str,
               measures: dict[str, dict[str, Measure]]) -> None:
    """envelope / every other transport, for every CPU source of ``measures``."""
    for source, by_transport in measures.items():
        result.ratios_to_envelope(f"{what}, {source} CPU per task", by_transport, SHORT)


# ------------------------------------------------------------- 4. end to end


POOLS = (("solo", 1), ("prefork", 2))


@dataclass
class Drained:
    """One publish-then-drain repetition of one transport and pool."""

    from_start: float  # tasks/s from worker spawn to the last task
    first_last: float  # tasks/s first to last task
    publish_rate: float  # apply_async tasks/s
    publish_cpu: dict[str, float]  # µs per apply_async: "publisher", "broker"
    drain_cpu: dict[str, float]  # µs per task drained: "worker", "broker"


def _e2e_once(ctx: Context, transport: str, pool: str, concurrency: int, n: int) -> Drained:
    """Publish ``n`` tasks, then drain them with one worker."""
    run = new_run_id()
    queue = f"bench.e2e.{run}"
    app, noop = publisher_app(ctx.url(transport), queue)
    with recording_client(ctx) as client:
        publish_rate, publish_cpu = apply_many(
            app, noop, n, lambda _: {"run": run, "total": n, "data": PAYLOAD},
            CpuClock({"publisher": this_process_s, "broker": broker_cpu(transport, client)}))
        app.close()
        with Worker(broker_url=ctx.url(transport), redis_url=ctx.redis_url, run=run,
                    queue=queue, pool=pool, concurrency=concurrency, kill_on_exit=True,
                    ) as worker:
            assert worker.pid is not None
            clock = CpuClock({"worker": process_tree_s(worker.pid),
                              "broker": broker_cpu(transport, client)})
            # The CPU window opens once the worker runs tasks (its start-up left out).
            wait_for(lambda: client.exists(run_key(run, "first")) == 1, 300, "the first task",
                     worker, step=0.01)
            done_before = int(client.get(run_key(run, "done")) or 0)
            before = clock.read()
            wait_for(lambda: client.exists(run_key(run, "last")) == 1, 300, "the last task",
                     worker, step=0.01)
            drain_cpu = clock.per_task_us(before, clock.read(), n - done_before)
            first = float(client.get(run_key(run, "first")) or 0)
            last = float(client.get(run_key(run, "last")) or 0)
            assert worker.started_at is not None
            spawned = worker.started_at
    cleanup(ctx, transport, queue)
    return Drained(n / (last - spawned), (n - 1) / max(last - first, 1e-6), publish_rate,
                   publish_cpu, drain_cpu)


#: CPU sources of publishing and of draining.
PUBLISH_CPU = ("publisher", "broker")
WORKER_CPU = ("worker", "broker")


def run_celery(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 4: N no-op tasks published, then drained by one real worker."""
    n = ctx.size("celery", "n")
    transports = ctx.celery_transports()
    result.params.update(tasks=n, pools=["solo", "prefork -c 2"], prefetch_multiplier=4,
                         loglevel="WARNING", gossip=False, mingle=False, heartbeat=False,
                         ignore_result=True)
    names = {pool: pool if concurrency == 1 else f"{pool} -c {concurrency}"
             for pool, concurrency in POOLS}
    publish = per_transport(result, transports, "apply_async", "tasks/s")
    publish_cpu = cpu_measures(result, transports, "apply_async", PUBLISH_CPU)
    start = {pool: per_transport(result, transports, f"{names[pool]}: worker start to "
                                 "last task", "tasks/s") for pool, _ in POOLS}
    steady = {pool: per_transport(result, transports, f"{names[pool]}: first to last task",
                                  "tasks/s") for pool, _ in POOLS}
    drain_cpu = {pool: cpu_measures(result, transports, f"{names[pool]} drain", WORKER_CPU)
                 for pool, _ in POOLS}
    for rep in range(ctx.repeat):
        for pool, concurrency in POOLS:
            for transport in transports:
                once = _e2e_once(ctx, transport, pool, concurrency, n)
                start[pool][transport].add(once.from_start)
                steady[pool][transport].add(once.first_last)
                add_cpu(drain_cpu[pool], transport, once.drain_cpu)
                if pool == "solo":
                    publish[transport].add(once.publish_rate)
                    add_cpu(publish_cpu, transport, once.publish_cpu)
                ctx.log(f"celery rep {rep + 1}: {pool} {LABELS[transport]}: "
                        f"{once.from_start:,.0f} tasks/s from worker start, "
                        f"{once.first_last:,.0f} first to last (published at "
                        f"{once.publish_rate:,.0f}/s); CPU per task: worker "
                        f"{once.drain_cpu['worker']:,.0f} µs, broker "
                        f"{once.drain_cpu['broker']:,.0f} µs")
    for pool, _ in POOLS:
        name = names[pool]
        result.ratios_to_envelope(f"{name}, worker start to last task", start[pool], SHORT)
        result.ratios_to_envelope(f"{name}, first to last task", steady[pool], SHORT)
        ratio = next(r for r in result.ratios
                     if r.label == f"{name}, worker start to last task: envelope / stock")
        result.target(f"Celery end to end ({name}) >= 1.0x stock", ratio, 1.0, unit="x")
        cpu_ratios(result, f"{name} drain", drain_cpu[pool])
    result.ratios_to_envelope("apply_async", publish, SHORT)
    cpu_ratios(result, "apply_async", publish_cpu)
    result.notes.append(
        "All tasks are published (apply_async, one producer) before the worker starts. "
        "\"Worker start\" is the moment the `celery worker` process is spawned, so that "
        "figure includes its start-up (about a second); \"first to last\" is the steady "
        "drain. Each task only INCRs a counter in Redis (same cost on every broker); "
        "results are ignored.")
    result.notes.append(
        cpu_note(transports) + " The drain's window opens once the first task has run (the "
        "worker's start-up is left out) and closes at the last one; it is divided by the "
        "tasks run in it.")


# ------------------------------------------------------------- 8. memory per task


def stored_bytes(client: RedisClient, transport: str, queue: str) -> int:
    """Size of one stored task message as the broker keeps it."""
    if transport == STOCK:
        return len(client.lindex(queue, 0) or b"")
    if transport == PLUS:
        tags = client.zrange(f"{PLUS_INDEX}{queue}", 0, 0)
        stored = client.hgetall(PLUS_MESSAGE + tags[0].decode()) if tags else {}
        return sum(len(k) + len(v) for k, v in stored.items())
    entries = client.xrange(task_stream(queue), count=1)
    return sum(len(k) + len(v) for k, v in entries[0][1].items()) if entries else 0


def run_memory(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 8: Redis used_memory per queued Celery task, no worker running."""
    n = ctx.size("memory", "n")
    transports = redis_transports(ctx)
    result.params.update(tasks=n, payload_bytes=payload_bytes())
    per_task = per_transport(result, transports, "used_memory per task", "bytes",
                             higher_is_better=False)
    raw = per_transport(result, transports, "stored message size", "bytes",
                        higher_is_better=False)
    for rep in range(ctx.repeat):
        for transport in transports:
            ctx.flush()
            run = new_run_id()
            queue = f"bench.memory.{run}"
            app, noop = publisher_app(ctx.url(transport), queue)
            kwargs: dict[str, Any] = {"run": run, "total": n, "data": PAYLOAD}

            def same(_: int, fixed: dict[str, Any] = kwargs) -> dict[str, Any]:
                return fixed

            apply_many(app, noop, 1, same)  # declares the queue, bindings, first stream node
            before = ctx.used_memory()
            apply_many(app, noop, n, same)
            after = ctx.used_memory()
            with recording_client(ctx) as client:
                raw[transport].add(stored_bytes(client, transport, queue))
            app.close()
            per_task[transport].add((after - before) / n)
            ctx.log(f"memory rep {rep + 1}: {LABELS[transport]}: "
                    f"{(after - before) / n:,.0f} bytes/task")
    ctx.flush()
    result.ratios_to_envelope("used_memory per task", per_task, SHORT)
    ratio = next(r for r in result.ratios if r.label == "used_memory per task: envelope / stock")
    result.target("Redis memory per queued task <= stock", ratio, 1.0, at_least=False,
                  unit="x")
    result.notes.append(
        "used_memory delta over N tasks published with apply_async (after one warm-up "
        "task). Stored message size: the list element (stock), the stream entry fields "
        "(envelope) or the message hash (celery-redis-plus) of one task.")


# ------------------------------------------------------------- 7. countdown


def seed_countdown(ctx: Context, transport: str, queue: str, run: str, n: int) -> None:
    """Publish one countdown task with apply_async, then copy it ``n - 1`` times.

    The copies are byte for byte what apply_async stores, with fresh task ids
    (and delivery tags); writing them in pipelines takes seconds where
    ``n`` apply_async calls would take minutes.
    """
    app, noop = publisher_app(ctx.url(transport), queue)
    with eta_property() if transport == PLUS else contextlib.nullcontext():
        apply_many(app, noop, 1, lambda _: {"run": run, "total": n, "data": PAYLOAD},
                   countdown=3600)
    app.close()
    with recording_client(ctx) as client:
        pipe = client.pipeline(transaction=False)
        if transport == PLUS:
            (tag, due), = client.zrange(PLUS_INDEX + queue, 0, 0, withscores=True)
            stored = client.hgetall(PLUS_MESSAGE + tag.decode())
            task_id = json.loads(stored[b"payload"])["headers"]["id"].encode()
            for index in range(n - 1):
                new_tag, new_id = str(uuid.uuid4()).encode(), str(uuid.uuid4()).encode()
                fields = dict(stored)
                fields[b"payload"] = (stored[b"payload"].replace(task_id, new_id)
                                      .replace(tag, new_tag))
                pipe.hset(PLUS_MESSAGE + new_tag.decode(), mapping=fields)
                pipe.zadd(PLUS_INDEX + queue, {new_tag: due})
                if index % 1000 == 999:
                    pipe.execute()
        elif transport == STOCK:
            template = client.lindex(queue, 0)
            message = json.loads(template)
            task_id = message["headers"]["id"].encode()
            tag = message["properties"]["delivery_tag"].encode()
            for index in range(n - 1):
                pipe.lpush(queue, template.replace(task_id, str(uuid.uuid4()).encode())
                           .replace(tag, str(uuid.uuid4()).encode()))
                if index % 1000 == 999:
                    pipe.execute()
        else:
            keys = Settings().keys.queue(queue)
            (task_id, stored), = client.hgetall(keys.delayed_data).items()
            score = client.zscore(keys.delayed, task_id)
            for index in range(n - 1):
                new_id = str(uuid.uuid4()).encode()
                pipe.hset(keys.delayed_data, new_id, stored.replace(task_id, new_id))
                pipe.zadd(keys.delayed, {new_id: score})
                if index % 1000 == 999:
                    pipe.execute()
        pipe.execute()


def _countdown_once(ctx: Context, transport: str, n: int, settle: float
                    ) -> tuple[float, float, float]:
    """(worker RSS MiB, Redis used_memory delta MiB, seconds to take in every task)."""
    ctx.flush()
    run = new_run_id()
    queue = f"bench.countdown.{run}"
    before = ctx.used_memory()
    seed_countdown(ctx, transport, queue, run, n)
    with recording_client(ctx) as client, Worker(
        broker_url=ctx.url(transport), redis_url=ctx.redis_url, run=run, queue=queue,
        kill_on_exit=True,
    ) as worker:
        ready = worker.wait_ready(client)
        if transport == STOCK:
            wait_for(lambda: client.llen(queue) == 0 and client.hlen("unacked") >= n,
                     600, "the worker to take every countdown task", worker, step=0.1)
        taken = time.time() - ready
        time.sleep(settle)
        rss = worker.rss_bytes() / MIB
        used = (ctx.used_memory() - before) / MIB
        waiting = {ENVELOPE: lambda: client.zcard(Settings().keys.queue(queue).delayed),
                   PLUS: lambda: client.zcard(PLUS_INDEX + queue) - client.zcard(
                       f"queue:{queue}")}.get(transport)
        if waiting is not None and waiting() != n:
            raise RuntimeError(f"{waiting()} of {n} countdown tasks still delayed")
    ctx.flush()
    return rss, used, taken


def run_countdown(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 7: N tasks with a one-hour countdown; worker RSS and Redis memory."""
    n = ctx.size("countdown", "n")
    settle = ctx.real("countdown", "settle_s")
    transports = redis_transports(ctx)
    result.params.update(tasks=n, countdown_s=3600, pool="solo", settle_s=settle)
    rss = per_transport(result, transports, "worker RSS", "MiB", higher_is_better=False)
    used = per_transport(result, transports, "Redis used_memory delta", "MiB",
                         higher_is_better=False)
    taken = result.measure(f"time for the worker to take in every task, {LABELS[STOCK]}",
                           STOCK, "s", higher_is_better=False)
    for rep in range(ctx.repeat):
        for transport in transports:
            worker_mib, redis_mib, seconds = _countdown_once(ctx, transport, n, settle)
            rss[transport].add(worker_mib)
            used[transport].add(redis_mib)
            if transport == STOCK:
                taken.add(seconds)
            ctx.log(f"countdown rep {rep + 1}: {LABELS[transport]}: worker RSS "
                    f"{worker_mib:,.0f} MiB, Redis +{redis_mib:,.1f} MiB")
    result.ratios_to_envelope("worker RSS", rss, SHORT)
    result.ratios_to_envelope("Redis used_memory delta", used, SHORT)
    result.notes.append(
        "One task is published with apply_async(countdown=3600) and copied byte for byte "
        "(fresh ids) to reach N. RSS (main process, solo pool) is read a few seconds after "
        "the worker is ready (envelope: the tasks wait in Redis) or after it has taken in "
        "every task (stock: it holds them in memory until due, and Redis keeps a copy in "
        "its `unacked` hash). celery-redis-plus keeps a task due in more than 60 s in "
        "Redis only (its message hash and `messages_index`), like envelope://; its one "
        "task is published with its eta handler connected, the copies are its hash and "
        "index entry with fresh ids.")


# ------------------------------------------------------------- 9. recovery


def _held(client: RedisClient, transport: str, queue: str) -> int:
    """Tasks delivered to a worker and not acknowledged (0 while some are unread)."""
    if transport == STOCK:
        return 0 if client.llen(queue) else int(client.hlen("unacked"))
    stream = task_stream(queue)
    group = Settings().consumer_group
    try:
        pending = int(client.xpending(stream, group)["pending"])
        unread = int(client.xlen(stream)) - pending
    except redis.ResponseError:
        return 0
    return 0 if unread else pending


def _recovery_once(ctx: Context, transport: str, held: int, options: dict[str, Any]
                   ) -> tuple[float, float]:
    """Seconds from SIGKILL to the first and to the last held task started elsewhere."""
    ctx.flush()
    run = new_run_id()
    queue = f"bench.recovery.{run}"
    url = ctx.url(transport)
    app, _ = publisher_app(url, queue, options)
    common: dict[str, Any] = {"broker_url": url, "redis_url": ctx.redis_url, "run": run,
                              "queue": queue, "transport_options": options,
                              "kill_on_exit": True}
    started_key = run_key(run, "started")
    with recording_client(ctx) as client, Worker(prefetch=1, **common) as survivor:
        survivor.wait_ready(client)
        # Keep the survivor busy (solo pool: it reads nothing more) until the crash.
        app.send_task("bench.hold", kwargs={"run": run}, queue=queue)
        wait_for(lambda: client.exists(run_key(run, "holding")) == 1, 30, "the hold task",
                 survivor)
        with Worker(pool="prefork", concurrency=1, prefetch=held + 1, **common) as victim:
            victim.wait_ready(client)
            with app.producer_or_acquire() as producer:
                for index in range(held + 1):
                    app.send_task("bench.record", kwargs={
                        "run": run, "index": index, "hold": index == 0, "data": PAYLOAD,
                    }, queue=queue, producer=producer)
            # Task 0 blocks the victim's only pool process; the others wait in its
            # buffer. Kill it as soon as it has them all.
            wait_for(lambda: _held(client, transport, queue) >= held, 30,
                     "the victim to take its tasks", victim, step=0.005)
            killed_at = time.time()
            victim.kill()
        client.set(run_key(run, "go"), 1)
        wanted = [str(index) for index in range(1, held + 1)]
        wait_for(lambda: None not in client.zmscore(started_key, wanted), 120,
                 "the held tasks to run on the survivor", survivor, step=0.01)
        starts = [float(score) for score in client.zmscore(started_key, wanted)]
    if min(starts) < killed_at:
        raise RuntimeError("a held task ran before the victim was killed")
    app.close()
    ctx.flush()
    return min(starts) - killed_at, max(starts) - killed_at


def run_recovery(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 9: time from SIGKILL of a worker holding tasks to them running elsewhere."""
    held = ctx.size("recovery", "held")
    lease_ms = ctx.size("recovery", "lease_ms")
    options: dict[str, dict[str, Any]] = {
        ENVELOPE: {"lease_ms": lease_ms},
        STOCK: {"visibility_timeout": lease_ms / 1000, "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1},
    }
    result.params.update(held_tasks=held, envelope_options=options[ENVELOPE],
                         stock_options=options[STOCK])
    first = {t: result.measure(f"kill to first held task running, {LABELS[t]}", t, "s",
                               higher_is_better=False) for t in (ENVELOPE, STOCK)}
    last = {t: result.measure(f"kill to last held task running, {LABELS[t]}", t, "s",
                              higher_is_better=False) for t in (ENVELOPE, STOCK)}
    for rep in range(ctx.repeat):
        for transport in (ENVELOPE, STOCK):
            to_first, to_last = _recovery_once(ctx, transport, held, options[transport])
            first[transport].add(to_first)
            last[transport].add(to_last)
            ctx.log(f"recovery rep {rep + 1}: {LABELS[transport]}: first {to_first:.2f} s, "
                    f"last {to_last:.2f} s")
    result.ratio("kill to last held task: envelope / stock", last[ENVELOPE], last[STOCK])
    result.notes.append(
        f"A prefork worker (-c 1, prefetch {held + 1}) takes {held + 1} tasks: the first "
        f"blocks its only pool process, the other {held} wait unacknowledged in its buffer. "
        "As soon as it holds them all, it and its pool process are SIGKILLed; a second "
        "worker, kept busy until that moment, must run them. envelope:// takes a dead consumer's "
        f"entries back once its liveness key has expired and they have been idle for "
        f"`lease_ms` ({lease_ms} ms; renewal and the takeover scan run every lease_ms/3). "
        "The stock transport restores any message unacknowledged for longer than "
        f"`visibility_timeout` ({lease_ms / 1000:g} s here, 3600 s by default), swept every "
        "`unacked_restore_interval` x `unacked_restore_throttle` seconds (set to 1 x 1 "
        "here, 10 x 10 by default); with so short a timeout it would also redeliver any "
        "task a live worker holds longer (countdown tasks, long queues of prefetched tasks), "
        "which the lease avoids.")
    result.notes.append(
        "celery-redis-plus is not measured here: it restores an unacknowledged task only "
        "once `visibility_timeout` + 60 s have passed, from a sweep every 60 s (both 60 s "
        "are a module constant, not a transport option), so one repetition would take one "
        "to two minutes.")
