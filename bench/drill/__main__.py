"""``python -m bench.drill``: the same as ``python -m bench drill``."""

from __future__ import annotations

from bench.drill.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
