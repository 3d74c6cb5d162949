"""One run of Celery's integration tests on one broker, on its own private redis-server.

Celery's ``t/integration/conftest.py`` reads the broker and result backend URLs from
``TEST_BROKER`` and ``TEST_BACKEND``, and its tasks reach Redis through ``REDIS_HOST`` and
``REDIS_PORT`` (database 0). ``WORKER_LOGLEVEL`` (read by ``celery.contrib.testing.worker``,
default ``error``) is set to ``info``: ``test_trace_log_arguments`` asserts the worker's
INFO records, and fails on every broker below that level. Each run gets a fresh server:
broker on database 1, result backend on database 2. Runs never share a server, since some
tests count the server's pub/sub channels.

pytest runs in a subprocess, in the extracted tree (Celery's own pytest settings apply),
with ``celery.contrib.pytest`` (the fixtures), :mod:`bench.celery_suite.plugin` and
pytest-timeout. ``pytest-rerunfailures`` is disabled: Celery's ``flaky`` marks are inert
and every test gets one attempt on each broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.celery_suite import ROOT
from bench.celery_suite.junit import CaseResult, Outcome, read_junit
from kombu_envelope.testing.redis_server import PrivateRedisServer

__all__ = ["BROKERS", "SUITES", "Broker", "BrokerRun", "run_broker"]

#: The Celery test files the harness knows, by short name.
SUITES = {
    "tasks": "t/integration/test_tasks.py",
    "canvas": "t/integration/test_canvas.py",
}

#: Environment variables Celery's integration tests read (replaced for each run), and
#: pytest's own (a caller's options must not leak into Celery's run).
_REPLACED_ENV = ("TEST_BROKER", "TEST_BACKEND", "REDIS_HOST", "REDIS_PORT", "WORKER_LOGLEVEL",
                 "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_CURRENT_TEST")

#: Log level of Celery's session worker (see the module documentation).
WORKER_LOGLEVEL = "info"

_BROKER_DB, _BACKEND_DB = 1, 2

#: Seconds an interrupted pytest gets to write its report before it is killed.
_INTERRUPT_GRACE_S = 60.0


@dataclass(frozen=True)
class Broker:
    """A broker under test: ``redis`` (kombu's stock transport) or ``envelope``."""

    name: str
    scheme: str

    @property
    def label(self) -> str:
        """``redis://`` or ``envelope://``."""
        return f"{self.scheme}://"

    def url(self, server: PrivateRedisServer) -> str:
        """The broker URL on ``server``."""
        return f"{self.scheme}://{server.host}:{server.port}/{_BROKER_DB}"


BROKERS = {b.name: b for b in (Broker("redis", "redis"), Broker("envelope", "envelope"))}


@dataclass
class BrokerRun:
    """What one broker's run produced."""

    broker: Broker
    files: tuple[str, ...]
    results: dict[str, CaseResult] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    #: Why the run gave no complete report (it did not finish, or wrote no report).
    error: str | None = None
    log_path: Path | None = None
    junit_path: Path | None = None
    #: Version of the private redis-server the run used.
    redis_version: str = ""

    def take_passes(self, rerun: BrokerRun, attempt: int) -> list[str]:
        """Tests that failed here and passed in ``rerun``: they count as passed on
        ``attempt``. Returns their ids."""
        passed = [test_id for test_id, result in rerun.results.items()
                  if result.outcome is Outcome.PASSED and test_id in self.results
                  and self.results[test_id].outcome.failing]
        for test_id in passed:
            self.results[test_id] = replace(rerun.results[test_id], attempt=attempt)
        self.seconds += rerun.seconds
        return passed

    def counts(self) -> Counter[Outcome]:
        """How many tests had each outcome."""
        return Counter(result.outcome for result in self.results.values())

    @property
    def passed(self) -> int:
        """Tests that passed."""
        return self.counts()[Outcome.PASSED]


def module_name(path: str) -> str:
    """``t/integration/test_tasks.py`` -> ``t.integration.test_tasks``."""
    return path.removesuffix(".py").replace("/", ".")


def node_id(files: tuple[str, ...], test_id: str) -> str:
    """pytest's node id of ``test_id`` (``test_tasks.py::...``) in one of ``files``."""
    name, _, inner = test_id.partition("::")
    for path in files:
        if path.rsplit("/", 1)[-1] == name:
            return f"{path}::{inner}"
    raise ValueError(f"{test_id!r} is in none of {files}")


def command(targets: tuple[str, ...], timeout_s: float, junit: Path,
            extra: tuple[str, ...] = ()) -> list[str]:
    """The pytest command line of a run (in the extracted tree): ``targets`` are files or
    node ids; ``extra`` goes last."""
    return [
        sys.executable, "-m", "pytest", *targets,
        "-p", "celery.contrib.pytest", "-p", "bench.celery_suite.plugin",
        "-p", "no:rerunfailures", "-p", "no:cacheprovider",
        f"--timeout={timeout_s:g}", f"--junitxml={junit}",
        "-ra", "--color=no", *extra,
    ]


def environment(broker: Broker, server: PrivateRedisServer) -> dict[str, str]:
    """The run's environment: this one, with Celery's test variables set for ``server``."""
    env = {k: v for k, v in os.environ.items() if k not in _REPLACED_ENV}
    env.update(
        TEST_BROKER=broker.url(server),
        TEST_BACKEND=f"redis://{server.host}:{server.port}/{_BACKEND_DB}",
        REDIS_HOST=server.host,
        REDIS_PORT=str(server.port),
        WORKER_LOGLEVEL=WORKER_LOGLEVEL,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        PYTHONDONTWRITEBYTECODE="1",  # runs may share the extracted tree at once
        PYTHONUNBUFFERED="1",
    )
    return env


def run_broker(
    broker: Broker,
    tests_dir: Path,
    files: tuple[str, ...],
    out_dir: Path,
    *,
    timeout_s: float = 60.0,
    run_timeout_s: float = 1800.0,
    pytest_args: tuple[str, ...] = (),
    select: tuple[str, ...] = (),
) -> BrokerRun:
    """Run ``files`` (paths relative to ``tests_dir``) against ``broker``.

    :param timeout_s: longest a single test may take (setup and teardown included).
    :param run_timeout_s: longest the whole run may take; past it the run is interrupted,
        reported with :attr:`BrokerRun.error` and the results of the tests that finished.
    :param pytest_args: more pytest arguments (``-k test_fail``), for both brokers alike.
    :param select: test ids (:mod:`~bench.celery_suite.junit`) to run instead of the whole
        files.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    run = BrokerRun(broker, files, log_path=out_dir / f"{broker.name}.log",
                    junit_path=out_dir / f"{broker.name}.xml")
    assert run.junit_path is not None and run.log_path is not None
    run.junit_path.unlink(missing_ok=True)
    with PrivateRedisServer() as server, run.log_path.open("wb") as log:
        run.redis_version = server.version
        started = time.monotonic()
        proc = subprocess.Popen(
            command(tuple(node_id(files, t) for t in select) or files, timeout_s,
                    run.junit_path, pytest_args), cwd=tests_dir,
            env=environment(broker, server), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            run.returncode = proc.wait(timeout=run_timeout_s)
        except subprocess.TimeoutExpired:
            run.error = f"the run did not finish within {run_timeout_s:g} s"
            _interrupt(proc)
        finally:
            _kill_group(proc)
        run.seconds = time.monotonic() - started
    if run.junit_path.is_file():  # after an interrupt: the tests that had finished
        run.results = read_junit(run.junit_path, map(module_name, files))
    elif run.error is None:
        run.error = f"pytest exited with status {run.returncode} and wrote no report"
    return run


def _interrupt(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT pytest, as Ctrl-C does: it stops and still writes the report of the tests
    that finished. Waits up to ``_INTERRUPT_GRACE_S`` for it."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=_INTERRUPT_GRACE_S)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of the run's process group (pool processes), then reap."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
