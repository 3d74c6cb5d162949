"""``python -m bench drill``: run the fault drill on one or both brokers, print the figures.

The default sizes are the large drill docs/operations.md reports (``--small`` for the
suite's); every size can be changed. The exit status is 0 when every ``envelope://``
drill passed: a stock ``redis://`` drill is a report, never a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.drill.config import (
    BROKERS,
    CLUSTER,
    CLUSTER_LARGE,
    ENVELOPE,
    LANGUAGES,
    LARGE,
    SENTINEL,
    SENTINEL_LARGE,
    SENTINEL_SMALL,
    SMALL,
    SMALL_CLUSTER,
    TOPOLOGIES,
    DrillConfig,
)
from bench.drill.run import run_drill


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options: one per drill size, plus the brokers and the outputs."""
    parser = argparse.ArgumentParser(
        prog="python -m bench drill",
        description="Fault drill: workers and Redis SIGKILLed while tasks are published; "
                    "counts lost tasks, duplicate effects and redelivered starts.")
    parser.add_argument("--small", action="store_true",
                        help="the suite's small drill instead of the large one")
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help=f"comma-separated, from {','.join(BROKERS)} (default both)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write every drill's figures and findings here")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="keep the worker logs here (default a temporary directory)")
    parser.add_argument("--details", action="store_true",
                        help="print the diagnostics even when a drill passed")
    parser.add_argument("--languages", type=_languages, default=None,
                        help=f"comma-separated worker languages, from {','.join(LANGUAGES)}, "
                             "round robin over --workers (default python)")
    for spec in dataclasses.fields(DrillConfig):
        if spec.name in ("broker", "languages"):
            continue
        default = getattr(LARGE, spec.name)
        kind: Any = type(default)
        nargs = None
        if isinstance(default, tuple):
            kind, nargs = type(default[0]), 2
        choices = TOPOLOGIES if spec.name == "topology" else None
        parser.add_argument(f"--{spec.name.replace('_', '-')}", type=kind, nargs=nargs,
                            default=None, choices=choices,
                            help=f"default {default} (small: {getattr(SMALL, spec.name)})"
                                 + (f"; one of {'|'.join(TOPOLOGIES)}" if choices else ""))
    return parser.parse_args(argv)


def _languages(text: str) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in LANGUAGES]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"languages must be among {','.join(LANGUAGES)}, "
                                         f"not {text!r}")
    return chosen


def configs(args: argparse.Namespace) -> list[DrillConfig]:
    """One config per chosen broker, from the preset and the options given (the
    Sentinel and Cluster presets with ``--topology sentinel|cluster``, which drill
    envelope:// only)."""
    if args.topology in (SENTINEL, CLUSTER):
        if args.topology == SENTINEL:
            base = SENTINEL_SMALL if args.small else SENTINEL_LARGE
        else:
            base = SMALL_CLUSTER if args.small else CLUSTER_LARGE
        if args.brokers == ",".join(BROKERS):
            args.brokers = ENVELOPE
    else:
        base = SMALL if args.small else LARGE
    changes = {spec.name: tuple(value) if isinstance(value, list) else value
               for spec in dataclasses.fields(DrillConfig)
               if (value := getattr(args, spec.name, None)) is not None}
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    if changes.get("topology") == CLUSTER:  # stock redis:// does not serve a Cluster
        brokers = [broker for broker in brokers if broker == ENVELOPE]
    return [base.replace(broker=broker, **changes) for broker in brokers]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the drills; non-zero when an envelope:// drill failed."""
    args = parse_args(argv)
    try:
        chosen = configs(args)
    except ValueError as exc:
        raise SystemExit(f"python -m bench drill: {exc}") from exc
    results = []
    failed = False
    for config in chosen:
        workdir = args.workdir / config.broker if args.workdir else None
        report = run_drill(config, workdir)
        results.append(report.to_json())
        if args.details or not report.passed:
            print(report.diagnostics(), flush=True)
        else:
            print(report.summary(), flush=True)
        failed = failed or (config.broker == ENVELOPE and not report.passed)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
