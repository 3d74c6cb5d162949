"""Celery scenarios: end to end, countdown tasks, memory per task, recovery after a crash."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    STOCK,
    Context,
    RedisClient,
    ScenarioResult,
    new_run_id,
)
from bench.payload import PAYLOAD, payload_bytes
from bench.stats import Measure
from bench.workers import Worker
from kombu_envelope import Settings
from kombu_envelope.envelope import PRIORITY_DEFAULT
from kombu_envelope.keys import bucket_for

LABELS = {ENVELOPE: "envelope://", STOCK: "redis:// (stock)", AMQP: "pyamqp:// (RabbitMQ)"}
MIB = 1024 * 1024


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


def apply_many(app: Celery, task: Any, count: int, kwargs: Callable[[int], dict[str, Any]],
               **options: Any) -> float:
    """``task.apply_async`` ``count`` times on one producer; return tasks/s."""
    with app.producer_or_acquire() as producer:
        started = perf_counter()
        for index in range(count):
            task.apply_async(kwargs=kwargs(index), producer=producer, **options)
        return count / (perf_counter() - started)


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


# ------------------------------------------------------------- 4. end to end


POOLS = (("solo", 1), ("prefork", 2))


def _e2e_once(ctx: Context, transport: str, pool: str, concurrency: int, n: int
              ) -> tuple[float, float, float]:
    """(tasks/s from worker start, tasks/s first to last task, publish tasks/s)."""
    run = new_run_id()
    queue = f"bench.e2e.{run}"
    app, noop = publisher_app(ctx.url(transport), queue)
    publish_rate = apply_many(app, noop, n, lambda _: {"run": run, "total": n, "data": PAYLOAD})
    app.close()
    with recording_client(ctx) as client, Worker(
        broker_url=ctx.url(transport), redis_url=ctx.redis_url, run=run, queue=queue,
        pool=pool, concurrency=concurrency, kill_on_exit=True,
    ) as worker:
        wait_for(lambda: client.exists(run_key(run, "last")) == 1, 300, "the last task",
                 worker, step=0.01)
        first = float(client.get(run_key(run, "first")) or 0)
        last = float(client.get(run_key(run, "last")) or 0)
        assert worker.started_at is not None
        spawned = worker.started_at
    cleanup(ctx, transport, queue)
    return n / (last - spawned), (n - 1) / max(last - first, 1e-6), publish_rate


def run_celery(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 4: N no-op tasks published, then drained by one real worker."""
    n = ctx.size("celery", "n")
    transports = [ENVELOPE, STOCK] + ([AMQP] if ctx.amqp_url else [])
    result.params.update(tasks=n, pools=["solo", "prefork -c 2"], prefetch_multiplier=4,
                         loglevel="WARNING", gossip=False, mingle=False, heartbeat=False,
                         ignore_result=True)
    start: dict[tuple[str, str], Measure] = {}
    steady: dict[tuple[str, str], Measure] = {}
    publish: dict[str, Measure] = {}
    for transport in transports:
        publish[transport] = result.measure(f"apply_async {LABELS[transport]}", transport,
                                            "tasks/s")
    for pool, concurrency in POOLS:
        name = pool if concurrency == 1 else f"{pool} -c {concurrency}"
        for transport in transports:
            start[pool, transport] = result.measure(
                f"{name}: worker start to last task, {LABELS[transport]}", transport, "tasks/s")
            steady[pool, transport] = result.measure(
                f"{name}: first to last task, {LABELS[transport]}", transport, "tasks/s")
    for rep in range(ctx.repeat):
        for pool, concurrency in POOLS:
            for transport in transports:
                from_start, first_last, pub = _e2e_once(ctx, transport, pool, concurrency, n)
                start[pool, transport].add(from_start)
                steady[pool, transport].add(first_last)
                if pool == "solo":
                    publish[transport].add(pub)
                ctx.log(f"celery rep {rep + 1}: {pool} {LABELS[transport]}: {from_start:,.0f} "
                        f"tasks/s from worker start, {first_last:,.0f} first to last "
                        f"(published at {pub:,.0f}/s)")
    for pool, concurrency in POOLS:
        name = pool if concurrency == 1 else f"{pool} -c {concurrency}"
        ratio = result.ratio(f"{name}, worker start to last task: envelope / stock",
                             start[pool, ENVELOPE], start[pool, STOCK])
        result.ratio(f"{name}, first to last task: envelope / stock",
                     steady[pool, ENVELOPE], steady[pool, STOCK])
        result.target(f"Celery end to end ({name}) >= 1.0x stock", ratio, 1.0, unit="x")
    result.ratio("apply_async: envelope / stock", publish[ENVELOPE], publish[STOCK])
    result.notes.append(
        "All tasks are published (apply_async, one producer) before the worker starts. "
        "\"Worker start\" is the moment the `celery worker` process is spawned, so that "
        "figure includes its start-up (about a second); \"first to last\" is the steady "
        "drain. Each task only INCRs a counter in Redis (same cost on every broker); "
        "results are ignored.")


# ------------------------------------------------------------- 8. memory per task


def stored_bytes(client: RedisClient, transport: str, queue: str) -> int:
    """Size of one stored task message as the broker keeps it."""
    if transport == STOCK:
        return len(client.lindex(queue, 0) or b"")
    entries = client.xrange(task_stream(queue), count=1)
    return sum(len(k) + len(v) for k, v in entries[0][1].items()) if entries else 0


def run_memory(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 8: Redis used_memory per queued Celery task, no worker running."""
    n = ctx.size("memory", "n")
    result.params.update(tasks=n, payload_bytes=payload_bytes())
    per_task = {t: result.measure(f"used_memory per task, {LABELS[t]}", t, "bytes",
                                  higher_is_better=False) for t in (ENVELOPE, STOCK)}
    raw = {t: result.measure(f"stored message size, {LABELS[t]}", t, "bytes",
                             higher_is_better=False) for t in (ENVELOPE, STOCK)}
    for rep in range(ctx.repeat):
        for transport in (ENVELOPE, STOCK):
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
    ratio = result.ratio("used_memory per task: envelope / stock", per_task[ENVELOPE],
                         per_task[STOCK])
    result.target("Redis memory per queued task <= stock", ratio, 1.0, at_least=False,
                  unit="x")
    result.notes.append(
        "used_memory delta over N tasks published with apply_async (after one warm-up "
        "task). Stored message size: the list element (stock) or the stream entry fields "
        "(envelope) of one task.")


# ------------------------------------------------------------- 7. countdown


def seed_countdown(ctx: Context, transport: str, queue: str, run: str, n: int) -> None:
    """Publish one countdown task with apply_async, then copy it ``n - 1`` times.

    The copies are byte for byte what apply_async stores, with fresh task ids
    (and delivery tags); writing them in pipelines takes seconds where
    ``n`` apply_async calls would take minutes.
    """
    app, noop = publisher_app(ctx.url(transport), queue)
    apply_many(app, noop, 1, lambda _: {"run": run, "total": n, "data": PAYLOAD},
               countdown=3600)
    app.close()
    with recording_client(ctx) as client:
        pipe = client.pipeline(transaction=False)
        if transport == STOCK:
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
        if transport == ENVELOPE:
            waiting = client.zcard(Settings().keys.queue(queue).delayed)
            if waiting != n:
                raise RuntimeError(f"{waiting} of {n} countdown tasks still delayed")
    ctx.flush()
    return rss, used, taken


def run_countdown(ctx: Context, result: ScenarioResult) -> None:
    """Scenario 7: N tasks with a one-hour countdown; worker RSS and Redis memory."""
    n = ctx.size("countdown", "n")
    settle = ctx.real("countdown", "settle_s")
    result.params.update(tasks=n, countdown_s=3600, pool="solo", settle_s=settle)
    rss = {t: result.measure(f"worker RSS, {LABELS[t]}", t, "MiB", higher_is_better=False)
           for t in (ENVELOPE, STOCK)}
    used = {t: result.measure(f"Redis used_memory delta, {LABELS[t]}", t, "MiB",
                              higher_is_better=False) for t in (ENVELOPE, STOCK)}
    taken = result.measure(f"time for the worker to take in every task, {LABELS[STOCK]}",
                           STOCK, "s", higher_is_better=False)
    for rep in range(ctx.repeat):
        for transport in (ENVELOPE, STOCK):
            worker_mib, redis_mib, seconds = _countdown_once(ctx, transport, n, settle)
            rss[transport].add(worker_mib)
            used[transport].add(redis_mib)
            if transport == STOCK:
                taken.add(seconds)
            ctx.log(f"countdown rep {rep + 1}: {LABELS[transport]}: worker RSS "
                    f"{worker_mib:,.0f} MiB, Redis +{redis_mib:,.1f} MiB")
    result.ratio("worker RSS: envelope / stock", rss[ENVELOPE], rss[STOCK])
    result.ratio("Redis used_memory delta: envelope / stock", used[ENVELOPE], used[STOCK])
    result.notes.append(
        "One task is published with apply_async(countdown=3600) and copied byte for byte "
        "(fresh ids) to reach N. RSS (main process, solo pool) is read a few seconds after "
        "the worker is ready (envelope: the tasks wait in Redis) or after it has taken in "
        "every task (stock: it holds them in memory until due, and Redis keeps a copy in "
        "its `unacked` hash).")


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
