"""``python -m bench.celery_suite``: Celery's integration tests on both brokers."""

from __future__ import annotations

from bench.celery_suite.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
