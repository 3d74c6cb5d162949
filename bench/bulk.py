"""Scenario 3: bulk publishing with ``Publisher.publish_many`` and ``Publisher.publish_iter``
(envelope only)."""

from __future__ import annotations

from time import perf_counter

from bench.core import ENVELOPE, Context, ScenarioResult, new_run_id
from bench.kombu_level import new_envelope
from kombu_envelope import Publisher, Settings

#: Envelopes per ``publish_many`` call.
CHUNK = 1000
#: Bulk target (Envelopes/s).
TARGET = 20_000
#: Hot-path targets (Envelopes/s): publish_many building its Envelopes, and Envelope.new.
HOT_PATH_TARGET = 50_000
NEW_TARGET = 100_000


def bulk_rate(ctx: Context, n: int, build_inside: bool, records: bool = True,
              drawn: bool = False) -> float:
    """Envelopes/s publishing ``n`` Envelopes in chunks of :data:`CHUNK` (with task
    records, or without: ``task_record_retention_s=0``); ``drawn``: in one
    ``publish_iter`` drawing them from a generator that builds them."""
    client = ctx.client()
    queue = f"bench.bulk.{new_run_id()}"
    publisher = Publisher(client, Settings() if records else Settings(task_record_retention_s=0))
    publisher.publish_many([(queue, new_envelope()) for _ in range(10)])  # warm up
    prebuilt = [] if build_inside else [new_envelope() for _ in range(n)]
    try:
        started = perf_counter()
        if drawn:
            publisher.publish_iter((queue, new_envelope()) for _ in range(n))
            return n / (perf_counter() - started)
        for start in range(0, n, CHUNK):
            size = min(CHUNK, n - start)
            if build_inside:
                chunk = [(queue, new_envelope()) for _ in range(size)]
            else:
                chunk = [(queue, envelope) for envelope in prebuilt[start:start + size]]
            publisher.publish_many(chunk)
        return n / (perf_counter() - started)
    finally:
        client.close()
        ctx.flush()


def new_rate(n: int) -> float:
    """Envelopes/s of ``Envelope.new`` alone (validation included), as built in the loop."""
    new_envelope()  # warm up
    started = perf_counter()
    for _ in range(n):
        new_envelope()
    return n / (perf_counter() - started)


def run_bulk(ctx: Context, result: ScenarioResult) -> None:
    """Envelopes/s with and without building the Envelopes inside the timed loop."""
    n = ctx.size("bulk", "n")
    result.params.update(envelopes=n, chunk=CHUNK)
    built = result.measure("publish_many, Envelopes built in the loop", ENVELOPE, "Envelopes/s")
    drawn = result.measure("publish_iter, Envelopes built as drawn", ENVELOPE, "Envelopes/s")
    ready = result.measure("publish_many, pre-built Envelopes", ENVELOPE, "Envelopes/s")
    unrecorded = result.measure("publish_many, pre-built Envelopes, task records off",
                                ENVELOPE, "Envelopes/s")
    new = result.measure("Envelope.new alone", ENVELOPE, "Envelopes/s")
    for rep in range(ctx.repeat):
        rate = new_rate(n)
        new.add(rate)
        ctx.log(f"bulk rep {rep + 1}: {new.label}: {rate:,.0f}/s")
        for measure, inside, records, iterated in (
                (built, True, True, False), (drawn, True, True, True),
                (ready, False, True, False), (unrecorded, False, False, False)):
            rate = bulk_rate(ctx, n, inside, records, iterated)
            measure.add(rate)
            ctx.log(f"bulk rep {rep + 1}: {measure.label}: {rate:,.0f}/s")
    result.ratio("pre-built, task records on / off", ready, unrecorded)
    result.target("bulk publish_many >= 20,000 Envelopes/s (built in the loop)", built, TARGET,
                  unit="Envelopes/s")
    result.target("bulk publish_many >= 20,000 Envelopes/s (pre-built)", ready, TARGET,
                  unit="Envelopes/s")
    result.target("bulk publish_many >= 50,000 Envelopes/s (built in the loop)", built,
                  HOT_PATH_TARGET, unit="Envelopes/s")
    result.target("publish_iter >= 50,000 Envelopes/s (built as drawn)", drawn,
                  HOT_PATH_TARGET, unit="Envelopes/s")
    result.target("Envelope.new >= 100,000 Envelopes/s", new, NEW_TARGET, unit="Envelopes/s")
    result.notes.append(
        "One pipelined round trip per chunk of 1000 (`Publisher.publish_many`); each "
        "Envelope is checked (`check_publishable`) and encoded in the call. "
        "`publish_iter` draws all N from one generator that builds them: each is checked "
        "and encoded as it is drawn, written 100 at a time and the replies read 1000 at a "
        "time, so Redis stores the first ones while the next are built.")
