"""Celery publish-to-start at a steady pace: tasks sent one by one to a ready worker,
the latency from each send to its start, and the CPU each side spends per task."""

from __future__ import annotations

import time

from bench.celery_app import run_key
from bench.celery_level import (
    LABELS,
    SHORT,
    add_cpu,
    cleanup,
    cpu_measures,
    cpu_ratios,
    per_transport,
    publisher_app,
    recording_client,
    wait_for,
)
from bench.core import Context, ScenarioResult, new_run_id, paced
from bench.cpu import CpuClock, broker_cpu, cpu_note, process_tree_s, this_process_s
from bench.payload import PAYLOAD
from bench.stats import percentile
from bench.workers import Worker


def _paced_once(ctx: Context, transport: str, rate: float, seconds: float
                ) -> tuple[list[float], dict[str, float]]:
    """Tasks sent at ``rate``/s for ``seconds`` to a ready worker: each one's
    publish-to-start latency (ms), and µs of CPU per task of publisher, worker, broker."""
    run = new_run_id()
    queue = f"bench.paced.{run}"
    count = max(int(rate * seconds), 1)
    started_key = run_key(run, "started")
    app, _noop = publisher_app(ctx.url(transport), queue)
    with recording_client(ctx) as client, Worker(
        broker_url=ctx.url(transport), redis_url=ctx.redis_url, run=run, queue=queue,
        kill_on_exit=True,
    ) as worker, app.producer_or_acquire() as producer:
        assert worker.pid is not None
        worker.wait_ready(client)
        publisher = CpuClock({"publisher": this_process_s})
        clock = CpuClock({"worker": process_tree_s(worker.pid),
                          "broker": broker_cpu(transport, client)})
        sent: list[float] = []
        before, published = clock.read(), publisher.read()
        for index in paced(rate, count):
            sent.append(time.time())
            app.send_task("bench.record", kwargs={"run": run, "index": index, "data": PAYLOAD},
                          queue=queue, producer=producer)
        cpu = publisher.per_task_us(published, publisher.read(), count)
        wait_for(lambda: client.zcard(started_key) >= count, 60, "every paced task to start",
                 worker, step=0.01)
        cpu.update(clock.per_task_us(before, clock.read(), count))
        starts = client.zmscore(started_key, [str(index) for index in range(count)])
    app.close()
    cleanup(ctx, transport, queue)
    return [(float(start) - at) * 1000 for start, at in zip(starts, sent)], cpu


#: CPU sources of a paced run.
PACED_CPU = ("publisher", "worker", "broker")


def run_paced(ctx: Context, result: ScenarioResult) -> None:
    """Publish-to-start p50/p99 of Celery tasks sent at a steady rate to a ready worker."""
    rate = ctx.real("paced", "rate")
    seconds = ctx.real("paced", "seconds")
    transports = ctx.celery_transports()
    result.params.update(rate_per_s=rate, seconds=seconds, pool="solo", prefetch_multiplier=4)
    latency = {pct: per_transport(result, transports, f"publish-to-start {pct}", "ms",
                                  higher_is_better=False) for pct in ("p50", "p99")}
    cpu = cpu_measures(result, transports, f"at {rate:g}/s", PACED_CPU)
    for rep in range(ctx.repeat):
        for transport in transports:
            values, per_task = _paced_once(ctx, transport, rate, seconds)
            for pct, by_transport in latency.items():
                by_transport[transport].add(percentile(values, float(pct[1:])))
            add_cpu(cpu, transport, per_task)
            ctx.log(f"paced rep {rep + 1}: {LABELS[transport]}: publish-to-start p50 "
                    f"{percentile(values, 50):.2f} ms p99 {percentile(values, 99):.2f} ms; "
                    f"CPU per task: worker {per_task['worker']:,.0f} µs, broker "
                    f"{per_task['broker']:,.0f} µs")
    for pct, by_transport in latency.items():
        result.ratios_to_envelope(f"publish-to-start {pct}", by_transport, SHORT)
    cpu_ratios(result, f"at {rate:g}/s", cpu)
    result.notes.append(
        "A `celery worker` (solo pool) is started and ready first; then tasks are sent one "
        "by one (`send_task`, what apply_async calls) at a steady pace. Each task writes "
        "its start time in Redis; latency = start - the moment just before its send_task "
        "(same machine clock), so it includes the publish itself.")
    result.notes.append(
        cpu_note(transports) + " Here the window is the whole paced run, so the worker's "
        "and the broker's figures include what they spend idle between tasks (polling, "
        "lease or visibility upkeep), divided by the tasks sent.")
