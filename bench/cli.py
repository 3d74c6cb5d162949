"""Command line of ``python -m bench``: choose scenarios and sizes, run, write reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import plus
from bench.bulk import run_bulk
from bench.celery_level import run_celery, run_countdown, run_memory, run_recovery
from bench.cluster import run_cluster
from bench.core import Context, Scenario, ScenarioResult
from bench.delayed import run_delayed
from bench.dispatcher import run_dispatcher
from bench.kombu_level import run_consume, run_latency, run_publish
from bench.limits import run_limits
from bench.paced import run_paced
from bench.report import write_json, write_markdown
from bench.sysinfo import amqp_server_version, load_average, machine_info
from bench.workers import ROOT
from kombu_envelope.testing.redis_server import PrivateRedisServer

AMQP_ENV = "BENCH_AMQP_URL"

#: Every scenario, in report order. ``repeat_cap`` limits the default number of
#: repetitions of a slow scenario (an explicit ``--repeat`` is never capped).
SCENARIOS = (
    Scenario("publish", "Publish throughput (kombu)",
             "One producer publishes N messages one at a time (msgs/s).",
             run_publish, {"n": 5_000}, {"n": 200}),
    Scenario("consume", "Consume + ack throughput (kombu)",
             "One consumer with basic_qos prefetch_count=100 drains N pre-published "
             "messages, acking each (msgs/s).",
             run_consume, {"n": 5_000}, {"n": 200}),
    Scenario("bulk", "Bulk publish with Publisher.publish_many and publish_iter (envelope only)",
             "N Envelopes published in chunks of 1000, or drawn by one publish_iter "
             "(Envelopes/s).",
             run_bulk, {"n": 30_000}, {"n": 2_000}),
    Scenario("celery", "Celery end to end",
             "N no-op tasks published, then drained by one `celery worker` subprocess "
             "(solo pool, then prefork with 2 processes).",
             run_celery, {"n": 1_500}, {"n": 100}),
    Scenario("paced", "Celery publish-to-start at a steady pace",
             "Tasks sent one by one at a fixed rate to a ready `celery worker` (solo pool): "
             "p50/p99 from publish to task start, and CPU per task of publisher, worker and "
             "broker.",
             run_paced, {"rate": 100, "seconds": 3, "repeat_cap": 3},
             {"rate": 100, "seconds": 0.3}),
    Scenario("latency", "Latency (kombu)",
             "Single publish round trip, and publish-to-start at a fixed moderate rate "
             "(p50/p99 per repetition).",
             run_latency, {"round_trips": 2_000, "rate": 500, "seconds": 2},
             {"round_trips": 100, "rate": 200, "seconds": 1}),
    Scenario("delayed", "Delayed-task promotion (envelope only)",
             "N tasks due at the same instant, promoted by one Promoter; then tasks due at "
             "a moderate steady rate.",
             run_delayed,
             {"n": 100_000, "moderate_rate": 20, "moderate_seconds": 10, "repeat_cap": 3},
             {"n": 2_000, "moderate_rate": 20, "moderate_seconds": 2}),
    Scenario("countdown", "100,000 countdown tasks: worker and Redis memory",
             "N tasks with a one-hour countdown waiting; worker RSS and Redis used_memory.",
             run_countdown, {"n": 100_000, "settle_s": 3, "repeat_cap": 1},
             {"n": 500, "settle_s": 1}),
    Scenario("memory", "Redis memory per queued Celery task",
             "used_memory delta / N for N queued tasks published with apply_async, "
             "no worker running.",
             run_memory, {"n": 2_000}, {"n": 100}),
    Scenario("recovery", "Recovery after a worker is killed",
             "Time from SIGKILL of a worker holding unacknowledged tasks to those tasks "
             "running on another worker.",
             run_recovery, {"held": 20, "lease_ms": 2_000}, {"held": 5, "lease_ms": 2_000}),
    Scenario("limits", "Limits per task type (envelope only)",
             "Consume + ack of N Envelope tasks without limits and with a concurrency cap "
             "that never binds; then the time from a slot freed by another worker to the "
             "delivery of the task parked behind it.",
             run_limits, {"n": 5_000, "rounds": 20}, {"n": 200, "rounds": 3}),
    Scenario("dispatcher", "Dispatcher HTTP API against the Python SDK",
             "Single POST /tasks at a fixed rate (p50/p99) and POST /tasks:batch of 1,000 "
             "(tasks/s), through one process and through --workers processes on several "
             "connections, next to Publisher.publish at the same rate and publish_many of "
             "1,000.",
             run_dispatcher, {"rate": 500, "seconds": 4, "batches": 10, "workers": 2,
                              "connections": 4},
             {"rate": 100, "seconds": 0.5, "batches": 1, "workers": 2, "connections": 2}),
    Scenario("cluster", "Redis Cluster (three shards) against one Redis",
             "N Envelopes spread over queues on every shard: bulk publish, consume+ack by "
             "one consumer of every queue, and publish-to-start at a fixed rate; the same "
             "on one Redis, in the same run. Only with --scenarios cluster.",
             run_cluster, {"n": 20_000, "queues": 6, "rate": 500, "seconds": 4},
             {"n": 1_000, "queues": 3, "rate": 200, "seconds": 1}, opt_in=True),
)
BY_KEY = {s.key: s for s in SCENARIOS}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark envelope:// against kombu's redis:// (with celery-redis-plus "
                    f"when it is importable, and RabbitMQ when ${AMQP_ENV} names a "
                    "reachable server) on one private redis-server.")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and one repetition (a smoke test, under a minute)")
    parser.add_argument("--scenarios", default="",
                        help=f"comma-separated subset of: {','.join(BY_KEY)}")
    parser.add_argument("--repeat", type=int, default=None,
                        help="repetitions per scenario (default 5; 1 with --quick)")
    parser.add_argument("--out-md", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="markdown report; only its generated section is replaced")
    parser.add_argument("--out-json", type=Path, default=ROOT / "docs" / "benchmarks.json",
                        help="JSON report")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SCENARIO.SIZE=VALUE",
                        help="override a size, e.g. --set delayed.n=20000 (repeatable)")
    parser.add_argument("--list", action="store_true", help="list scenarios and sizes, exit")
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="run nothing: rewrite the markdown section from a JSON report")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def _sizes(quick: bool, overrides: list[str]) -> dict[str, dict[str, float]]:
    sizes = {s.key: dict(s.quick_sizes if quick else s.sizes) for s in SCENARIOS}
    for item in overrides:
        name, _, value = item.partition("=")
        scenario, _, size = name.partition(".")
        if scenario not in sizes or not size or not value:
            raise SystemExit(f"--set {item!r}: expected SCENARIO.SIZE=VALUE")
        sizes[scenario][size] = float(value)
    return sizes


def _amqp_url() -> tuple[str | None, str]:
    url = os.environ.get(AMQP_ENV)
    if not url:
        return None, f"${AMQP_ENV} is not set"
    if amqp_server_version(url) is None:
        return None, f"no RabbitMQ reachable at ${AMQP_ENV}"
    return url, ""


def _flags(argv: list[str]) -> str:
    """The command-line flags worth repeating in the report (output paths left out)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out-md", "--out-json"):
            skip = True
        elif not arg.startswith(("--out-md=", "--out-json=")):
            kept.append(arg)
    return " ".join(kept)


def run_scenario(scenario: Scenario, ctx: Context) -> ScenarioResult:
    """Run one scenario; a failure is recorded in the result, not raised."""
    number = next(i for i, known in enumerate(SCENARIOS, 1) if known is scenario)
    result = ScenarioResult(scenario.key, scenario.title, scenario.description, number)
    started = time.monotonic()
    ctx.log(f"scenario {scenario.key}: {ctx.repeat} repetition(s)")
    try:
        ctx.flush()
        scenario.run(ctx, result)
    except Exception:
        result.error = traceback.format_exc()
        ctx.log(f"scenario {scenario.key} failed:\n{result.error}")
    result.seconds = time.monotonic() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen scenarios and write both reports; non-zero if one failed."""
    args = parse_args(argv)
    if args.from_json:
        write_markdown(args.out_md, json.loads(args.from_json.read_text(encoding="utf-8")))
        return 0
    sizes = _sizes(args.quick, args.overrides)
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.key:10} {scenario.title}: {sizes[scenario.key]}")
        return 0
    chosen = ([s.strip() for s in args.scenarios.split(",") if s.strip()]
              or [s.key for s in SCENARIOS if not s.opt_in])
    unknown = [s for s in chosen if s not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(unknown)}; choose from "
                         f"{', '.join(BY_KEY)}")
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 5)
    amqp_url, amqp_note = _amqp_url()
    plus_loaded, plus_note = plus.load()
    started = time.monotonic()
    with PrivateRedisServer() as server:
        base = Context(redis_url=server.url, amqp_url=amqp_url, repeat=repeat,
                       quick=args.quick, sizes=sizes, verbose=not args.quiet,
                       plus=plus_loaded)
        machine = machine_info(server.url, amqp_url)
        machine["celery_redis_plus"] = plus_note if plus_loaded else None
        results = []
        repeats: dict[str, int] = {}
        for key in (k for k in BY_KEY if k in chosen):
            cap = sizes[key].get("repeat_cap")
            reps = repeat if args.repeat is not None or cap is None else min(repeat, int(cap))
            repeats[key] = reps
            results.append(run_scenario(BY_KEY[key], dataclasses.replace(base, repeat=reps)))
    machine["load_end"] = load_average()
    flags = _flags(list(argv) if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "machine": machine,
        "config": {"repeat": repeat, "repeats": repeats, "quick": args.quick,
                   "scenarios": chosen,
                   "sizes": {k: sizes[k] for k in chosen}, "amqp_note": amqp_note,
                   "plus_note": "" if plus_loaded else plus_note,
                   "command_flags": f" {flags}" if flags else ""},
        "seconds": time.monotonic() - started,
        "scenarios": [r.to_json() for r in results],
    }
    write_markdown(args.out_md, report)
    write_json(args.out_json, report)
    failed = [r.key for r in results if r.error]
    if not args.quiet:
        print(f"wrote {args.out_md} and {args.out_json}"
              + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0
