"""Celery's own integration suite on ``envelope://`` beside the stock ``redis://`` broker.

``python -m bench.celery_suite`` fetches the sdist of the installed Celery from PyPI
(:mod:`~bench.celery_suite.sdist`, cached in ``.cache/celery-suite/``), runs its
``t/integration`` tests with pytest once per broker, each on its own private
``redis-server`` (:mod:`~bench.celery_suite.run`, with :mod:`~bench.celery_suite.plugin`
loaded into pytest), reads the outcome of every test from the JUnit XML
(:mod:`~bench.celery_suite.junit`) and prints them side by side
(:mod:`~bench.celery_suite.compare`). Every test that fails on ``envelope://`` only must
be explained in ``docs/celery-compatibility.md`` (:mod:`~bench.celery_suite.explained`).
"""

from __future__ import annotations

from pathlib import Path

#: Repository root: the plugin is imported from here, the cache and the docs live here.
ROOT = Path(__file__).resolve().parents[2]
