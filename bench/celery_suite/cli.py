"""Command line of ``python -m bench.celery_suite``: fetch, run both brokers, compare.

Exit status: 0 when the comparison holds (``envelope://`` passes at least as many tests as
``redis://``, and every test failing on ``envelope://`` only is explained in
``docs/celery-compatibility.md``), 1 when it does not, 2 when the harness itself could not
run (no sdist, a run that did not finish).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from bench.celery_suite.compare import Comparison
from bench.celery_suite.explained import DOC, explanations
from bench.celery_suite.rerun import rerun_differences
from bench.celery_suite.run import BROKERS, SUITES, BrokerRun, run_broker
from bench.celery_suite.sdist import SdistError, celery_tests, default_cache, installed_celery


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.celery_suite",
        description="Run Celery's own integration tests against envelope:// (with "
                    "`import celery_ext`) and the stock redis:// broker, each on a private "
                    "redis-server, and compare them test by test.")
    parser.add_argument("--suite", action="append", choices=[*SUITES, "all"],
                        help="Celery test file(s) to run: tasks (t/integration/test_tasks.py, "
                             "the default), canvas (test_canvas.py, slow), all; repeatable")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="longest one test may run, Celery's own longer marks included "
                             "(default 60)")
    parser.add_argument("--run-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="longest one broker's whole run may take (default 3600)")
    parser.add_argument("--reruns", type=int, default=1, metavar="N",
                        help="run a test failing on one broker only again on that broker, "
                             "up to N times; a pass then counts (default 1; 0: never)")
    parser.add_argument("--rerun-limit", type=int, default=5, metavar="N",
                        help="no reruns on a broker where more than N tests fail only "
                             "there (default 5)")
    parser.add_argument("--serial", action="store_true",
                        help="run the brokers one after the other (default: at the same "
                             "time, each on its own redis-server)")
    parser.add_argument("--out-dir", type=Path, default=None, metavar="DIR",
                        help="JUnit reports and pytest logs (default "
                             ".cache/celery-suite/last-run)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the comparison as JSON")
    parser.add_argument("--celery-version", default=None, metavar="VERSION",
                        help="whose tests to run (default: the installed Celery's)")
    parser.add_argument("--differences-only", action="store_true",
                        help="print only the tests whose outcome differs")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    parser.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARG",
                        help="after --: more pytest arguments for both runs, e.g. "
                             "-- -k 'test_fail or test_eta'")
    return parser.parse_args(argv)


def _files(suites: list[str] | None) -> tuple[str, ...]:
    chosen = suites or ["tasks"]
    if "all" in chosen:
        chosen = list(SUITES)
    return tuple(dict.fromkeys(SUITES[name] for name in chosen))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; print the table; return the exit status."""
    args = parse_args(argv)
    say = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr,
                                                                  flush=True))
    files = _files(args.suite)
    version = args.celery_version or installed_celery()
    try:
        tests_dir = celery_tests(version)
    except SdistError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or default_cache() / "last-run"
    say(f"celery {version} tests in {tests_dir}; reports in {out_dir}")
    say(f"running {', '.join(files)} on redis:// and envelope://"
        f"{' one after the other' if args.serial else ' at the same time'}")

    def one(name: str) -> BrokerRun:
        run = run_broker(BROKERS[name], tests_dir, files, out_dir, timeout_s=args.timeout,
                         run_timeout_s=args.run_timeout,
                         pytest_args=tuple(args.pytest_args))
        say(f"{run.broker.label} finished in {run.seconds:.0f} s: {run.passed} passed"
            f"{'; ' + run.error if run.error else ''}")
        return run

    def again(run: BrokerRun, tests: tuple[str, ...], attempt: int) -> BrokerRun:
        say(f"{run.broker.label}: attempt {attempt} of {len(tests)} tests failing there only")
        return run_broker(run.broker, tests_dir, files, out_dir / f"attempt-{attempt}",
                          timeout_s=args.timeout, run_timeout_s=args.run_timeout,
                          pytest_args=tuple(args.pytest_args), select=tests)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1 if args.serial else 2) as pool:
        stock_future, envelope_future = pool.submit(one, "redis"), pool.submit(one, "envelope")
        stock, envelope = stock_future.result(), envelope_future.result()
    if not (stock.error or envelope.error):
        for name, tests in rerun_differences(stock, envelope, again, args.reruns,
                                             args.rerun_limit).items():
            for test_id in tests:
                say(f"{BROKERS[name].label}: {test_id} passed on a rerun")
    comparison = Comparison(stock, envelope, explanations(DOC))

    print(f"Celery {version} integration tests ({', '.join(files)}), "
          f"{datetime.now(timezone.utc):%Y-%m-%d}, Python {platform.python_version()}, "
          f"Redis {stock.redis_version}, {os.cpu_count()} cores, "
          f"{time.monotonic() - started:.0f} s")
    print(comparison.table(all_rows=not args.differences_only))
    for label, rows in (("envelope:// only", comparison.envelope_only()),
                        ("redis:// only", comparison.stock_only())):
        for row in rows:
            why = comparison.explained.get(row.test_id, "(not explained in the docs)")
            print(f"\n{label}: {row.test_id}\n  {why}")
    problems = comparison.problems()
    for problem in problems:
        print(f"FAIL: {problem}")
    if args.json is not None:
        report = {"celery": version, "python": platform.python_version(),
                  "reruns": args.reruns, "rerun_limit": args.rerun_limit,
                  "redis_server": stock.redis_version, "cpu_count": os.cpu_count(),
                  "timeout_s": args.timeout, "serial": args.serial,
                  "seconds": round(time.monotonic() - started, 1), **comparison.as_dict()}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if stock.error or envelope.error:
        return 2
    return 1 if problems else 0
