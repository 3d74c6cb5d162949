"""Scenario 6: promotion of delayed tasks by one :class:`Promoter` (envelope only).

Lateness is measured in Redis itself: a promoted task's stream entry id starts
with the server time (ms) of its ``XADD``, compared with the task's due time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from time import perf_counter

from bench.core import ENVELOPE, Context, RedisClient, ScenarioResult, new_run_id
from bench.kombu_level import new_envelope
from bench.payload import PAYLOAD, TASK_TYPE
from bench.stats import percentile
from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import PRIORITY_DEFAULT, utcnow
from kombu_envelope.keys import bucket_for
from kombu_envelope.store.promoter import Promoter

CHUNK = 1000
#: Lateness target at moderate load (ms, p99).
TARGET_P99_MS = 100.0


@contextmanager
def promoter(ctx: Context) -> Iterator[Promoter]:
    """One running Promoter on the private Redis."""
    running = Promoter(ctx.client, Settings())
    running.start()
    try:
        yield running
    finally:
        running.stop()


#: Entry ids of a stream page, without their fields (100,000 bodies would take seconds).
_IDS_SCRIPT = """
local page = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
local ids = {}
for i, entry in ipairs(page) do ids[i] = entry[1] end
return ids
"""


def _entry_ms(client: RedisClient, stream: str) -> list[int]:
    """The time (ms) in the id of every entry of ``stream``, oldest first."""
    read_ids = client.register_script(_IDS_SCRIPT)
    stamps: list[int] = []
    start = "-"
    while True:
        ids = read_ids(keys=[stream], args=[start, 10_000])
        if not ids:
            return stamps
        stamps.extend(int(entry_id.split(b"-")[0]) for entry_id in ids)
        millis, seq = ids[-1].decode().split("-")
        start = f"{millis}-{int(seq) + 1}"


def _wait_promoted(client: RedisClient, delayed_key: str, stream: str, n: int,
                   deadline: float) -> None:
    while time.monotonic() < deadline:
        if client.zcard(delayed_key) == 0 and client.xlen(stream) >= n:
            return
        time.sleep(0.05)
    raise RuntimeError(f"only {client.xlen(stream)} of {n} delayed tasks promoted in time")


def _publish(publisher: Publisher, queue: str, count: int,
             make: Callable[[int], Envelope]) -> None:
    """Publish ``make(0)`` .. ``make(count - 1)`` in chunks, building each chunk just in time."""
    for start in range(0, count, CHUNK):
        publisher.publish_many(
            [(queue, make(i)) for i in range(start, min(start + CHUNK, count))])


def burst(ctx: Context, n: int) -> tuple[float, list[float], bool]:
    """``n`` tasks due at one instant: (promotion rate/s, lateness ms, publish overran)."""
    client = ctx.client()
    keys = Settings().keys.queue(f"bench.delayed.{new_run_id()}")
    stream = keys.stream(bucket_for(PRIORITY_DEFAULT))
    publisher = Publisher(client, Settings())
    # Build and publish cost per task, to choose a due time after the last publish.
    sample_started = perf_counter()
    _publish(publisher, f"bench.scratch.{new_run_id()}", CHUNK, lambda _: new_envelope())
    per_task_s = (perf_counter() - sample_started) / CHUNK
    due = utcnow() + timedelta(seconds=1.0 + 1.5 * per_task_s * n)
    with promoter(ctx):
        _publish(publisher, keys.queue, n,
                 lambda _: Envelope.new(task_type=TASK_TYPE, payload=PAYLOAD, schedule_time=due))
        overran = utcnow() >= due
        due_ms = Envelope.new(task_type=TASK_TYPE, schedule_time=due).due_ms()
        _wait_promoted(client, keys.delayed, stream,
                       n, time.monotonic() + 120 + (due - utcnow()).total_seconds())
    stamps = _entry_ms(client, stream)
    client.close()
    ctx.flush()
    spread_s = max((stamps[-1] - stamps[0]) / 1000, 0.001)
    return n / spread_s, [ms - due_ms for ms in stamps], overran


def moderate(ctx: Context, rate: float, seconds: float) -> list[float]:
    """Tasks due ``rate`` per second over ``seconds``; return each task's lateness (ms)."""
    client = ctx.client()
    keys = Settings().keys.queue(f"bench.delayed.{new_run_id()}")
    stream = keys.stream(bucket_for(PRIORITY_DEFAULT))
    publisher = Publisher(client, Settings())
    count = max(int(rate * seconds), 1)
    with promoter(ctx):
        first: datetime = utcnow() + timedelta(seconds=1)
        _publish(publisher, keys.queue, count, lambda i: Envelope.new(
            task_type=TASK_TYPE, payload=PAYLOAD,
            schedule_time=first + timedelta(seconds=i / rate)))
        _wait_promoted(client, keys.delayed, stream, count,
                       time.monotonic() + seconds + 30)
    lateness = [float(int(entry_id.split(b"-")[0]) - decode_entry(fields).due_ms())
                for entry_id, fields in client.xrange(stream, count=count + 1)]
    client.close()
    ctx.flush()
    return lateness


def run_delayed(ctx: Context, result: ScenarioResult) -> None:
    """A burst of N tasks due together, then a moderate steady flow."""
    n = ctx.size("delayed", "n")
    rate = ctx.real("delayed", "moderate_rate")
    seconds = ctx.real("delayed", "moderate_seconds")
    result.params.update(burst_tasks=n, moderate_rate_per_s=rate, moderate_seconds=seconds,
                         promoters=1, promote_batch=1000)
    speed = result.measure("burst: promotion rate (first to last entry)", ENVELOPE, "tasks/s")
    p50 = result.measure("burst: lateness p50", ENVELOPE, "ms", higher_is_better=False)
    p99 = result.measure("burst: lateness p99", ENVELOPE, "ms", higher_is_better=False)
    worst = result.measure("burst: lateness max", ENVELOPE, "ms", higher_is_better=False)
    m50 = result.measure(f"moderate ({rate:g}/s): lateness p50", ENVELOPE, "ms",
                         higher_is_better=False)
    m99 = result.measure(f"moderate ({rate:g}/s): lateness p99", ENVELOPE, "ms",
                         higher_is_better=False)
    mmax = result.measure(f"moderate ({rate:g}/s): lateness max", ENVELOPE, "ms",
                          higher_is_better=False)
    overruns = 0
    for rep in range(ctx.repeat):
        rate_s, late, overran = burst(ctx, n)
        overruns += overran
        speed.add(rate_s)
        p50.add(percentile(late, 50))
        p99.add(percentile(late, 99))
        worst.add(max(late))
        steady = moderate(ctx, rate, seconds)
        m50.add(percentile(steady, 50))
        m99.add(percentile(steady, 99))
        mmax.add(max(steady))
        ctx.log(f"delayed rep {rep + 1}: burst {rate_s:,.0f}/s, lateness p50 "
                f"{percentile(late, 50):.0f} ms p99 {percentile(late, 99):.0f} ms; moderate "
                f"p50 {percentile(steady, 50):.1f} ms p99 {percentile(steady, 99):.1f} ms")
    result.target(f"delayed lateness p99 <= 100 ms at moderate load ({rate:g}/s)", m99,
                  TARGET_P99_MS, at_least=False, unit="ms")
    result.notes.append(
        "Lateness = stream entry id time (Redis clock at XADD) minus the due time. In the "
        "burst the due time is chosen after the last publish, with the Promoter already "
        "running and asleep until then; its lateness is mostly queueing behind the other "
        "tasks, so the rate is the figure to read. The moderate tasks are all published "
        "ahead, due at a steady rate.")
    if overruns:
        result.notes.append(f"In {overruns} repetition(s) publishing ended after the due time.")
