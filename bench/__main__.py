"""``python -m bench``: run the benchmarks and write the reports."""

from __future__ import annotations

from bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
