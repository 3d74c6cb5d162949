"""Limits per task type (docs/protocol.md, section 19): what they cost, how fast a slot
is reused.

* Consume + ack of N Envelope tasks, prefetch 100, on a queue without limits and on the
  same kind of queue whose task type has a concurrency cap far above what runs (limits
  configured, not binding): the paired ratio is the price of the check in ``read.lua``.
* Slot reuse: a concurrency of one held by another worker, a task of that type parked
  behind it and a consumer waiting; the time from the other worker's settle freeing it to the
  parked task's delivery.
"""

from __future__ import annotations

import threading
from time import perf_counter, sleep
from typing import Any

from kombu import Consumer

from bench.core import ENVELOPE, Context, ScenarioResult
from bench.kombu_level import (
    ACCEPT,
    ENVELOPE_TASKS,
    bench_queue,
    connect,
    drain,
    new_envelope,
    prepublish,
)
from bench.payload import TASK_TYPE
from bench.stats import percentile
from kombu_envelope import Publisher, Settings
from kombu_envelope.store.slots import free_slot
from kombu_envelope.store.task_limits import TaskLimit, TaskLimits

#: A cap no benchmark reaches: configured, never binding.
UNREACHED = 1_000_000
#: What the other worker's slot is called (a member no consumer ever holds).
OTHER = "elsewhere 0-1"


def run_limits(ctx: Context, result: ScenarioResult) -> None:
    """Consume + ack with and without (non-binding) limits, then the slot reuse time."""
    n, rounds = ctx.size("limits", "n"), ctx.size("limits", "rounds")
    result.params.update(messages=n, prefetch_count=100, slot_rounds=rounds)
    plain = result.measure("consume+ack, no limits", ENVELOPE, "msgs/s")
    limited = result.measure(f"consume+ack, concurrency {UNREACHED:,} (not binding)",
                             ENVELOPE, "msgs/s")
    for rep in range(ctx.repeat):
        for measure, limit in ((plain, None), (limited, TaskLimit(concurrency=UNREACHED))):
            with bench_queue(ctx, ENVELOPE, "bench.limits") as (conn, queue):
                if limit is not None:
                    client = ctx.client()
                    TaskLimits(client, Settings()).set(queue.name, TASK_TYPE, limit)
                    client.close()
                prepublish(ctx, conn, queue, ENVELOPE_TASKS, n)
                rate = n / drain(conn, queue, n)
            measure.add(rate)
            ctx.log(f"limits rep {rep + 1}: {measure.label}: {rate:,.0f} msgs/s")
    ratio = result.ratio("limits configured, not binding / none", limited, plain)
    result.target("throughput with non-binding limits >= 0.9x without", ratio, 0.9, unit="x")

    reuse = result.measure("slot freed elsewhere -> parked task delivered, p99", ENVELOPE,
                           "ms", higher_is_better=False)
    median = result.measure("slot freed elsewhere -> parked task delivered, p50", ENVELOPE,
                            "ms", higher_is_better=False)
    for rep in range(ctx.repeat):
        waits = _slot_reuse(ctx, rounds)
        reuse.add(percentile(waits, 99))
        median.add(percentile(waits, 50))
        ctx.log(f"limits rep {rep + 1}: slot reuse p50 {percentile(waits, 50):.1f} ms, "
                f"p99 {percentile(waits, 99):.1f} ms")
    result.target("delivery resumes within 50 ms of a slot freeing (p99)", reuse, 50.0,
                  at_least=False, unit="ms")
    result.notes.append(
        "The consumer is a kombu consumer of the plain transport. For slot reuse, a slot of "
        "the only one is held by a member no consumer holds (another worker, as far as "
        "Redis can tell); a task is published, read and parked behind it while the "
        "consumer waits, and 100 ms later the slot is freed as a settle frees it (`ZREM` and the "
        "append to `slot-freed`, one `MULTI`).")


def _slot_reuse(ctx: Context, rounds: int) -> list[float]:
    """Milliseconds from freeing the only slot to the parked task's delivery, per round."""
    settings = Settings()
    client = ctx.client()
    delivered = threading.Event()
    at: list[float] = []

    def on_message(_body: Any, message: Any) -> None:
        at.append(perf_counter())
        message.ack()
        delivered.set()

    with bench_queue(ctx, ENVELOPE, "bench.limits.reuse") as (_conn, queue):
        running = settings.keys.queue(queue.name).running(TASK_TYPE)
        TaskLimits(client, settings).set(queue.name, TASK_TYPE, TaskLimit(concurrency=1))
        stop = threading.Event()

        def consume() -> None:
            with connect(ctx.url(ENVELOPE)) as own, Consumer(
                    own.channel(), queues=[queue], callbacks=[on_message], accept=ACCEPT):
                while not stop.is_set():
                    try:
                        own.drain_events(timeout=0.5)
                    except TimeoutError:
                        continue

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        publisher = Publisher(client, settings)
        waits = []
        try:
            for _ in range(rounds):
                delivered.clear()
                client.zadd(running, {OTHER: 2**50})
                publisher.publish(queue.name, new_envelope())
                sleep(0.1)  # read, parked, and the consumer waiting again
                freed = perf_counter()
                pipe = client.pipeline(transaction=True)
                free_slot(pipe, running, OTHER)  # as the other worker's settle does
                pipe.execute()
                if not delivered.wait(10):
                    raise RuntimeError("the parked task was not delivered after its slot freed")
                waits.append((at[-1] - freed) * 1000)
        finally:
            stop.set()
            consumer.join(5)
            client.close()
    return waits
