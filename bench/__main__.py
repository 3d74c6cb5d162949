"""``python -m bench``: run the benchmarks and write the reports; ``python -m bench drill``
runs the fault drill instead (see :mod:`bench.drill`)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["drill"]:
        from bench.drill.cli import main as drill

        raise SystemExit(drill(sys.argv[2:]))
    from bench.cli import main

    raise SystemExit(main())
