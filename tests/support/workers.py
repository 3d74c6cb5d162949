"""Run real ``celery worker`` subprocesses from tests."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil

__all__ = ["PROJECT_ROOT", "TESTS_DIR", "CeleryWorker", "worker_fleet"]

TESTS_DIR = Path(__file__).resolve().parent.parent
"""The ``tests/`` directory (always on the worker's PYTHONPATH)."""

PROJECT_ROOT = TESTS_DIR.parent
"""Repository root (also on the worker's PYTHONPATH)."""

_READY_RE = re.compile(r"\S+@\S+ ready\.")
_POLL_INTERVAL = 0.05

_LIVE: weakref.WeakSet[CeleryWorker] = weakref.WeakSet()


class CeleryWorker:
    """A ``python -m celery -A <app> worker`` subprocess.

    stdout and stderr go to one log file (see :meth:`log_text`).  Use as a
    context manager to start (waiting for readiness) and stop it::

        with CeleryWorker("apps.stock_app", env={"TEST_BROKER_URL": url}) as w:
            ...
    """

    def __init__(
        self,
        app: str,
        *,
        pool: str = "solo",
        concurrency: int = 1,
        hostname: str | None = None,
        queues: Sequence[str] | None = None,
        loglevel: str = "INFO",
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        log_path: str | os.PathLike[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        gossip: bool = True,
        mingle: bool = True,
        heartbeat: bool = True,
        ready_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        """Configure (but do not start) a worker.

        :param app: value for ``-A``, e.g. ``"apps.stock_app"`` (importable via
            the tests directory, which is always put on PYTHONPATH).
        :param pool: ``"solo"``, ``"prefork"``, ``"threads"``...
        :param hostname: node name; default ``w-<random>@localhost``.
        :param queues: ``-Q`` queue names; default: the app's default queue.
        :param env: extra environment variables (broker URL, key prefix...).
        :param extra_args: appended to the ``celery worker`` command line.
        :param pythonpath: extra entries prepended to PYTHONPATH.
        :param log_path: log file; default a temp file removed by :meth:`close`.
        :param gossip: Celery's default (on); False adds ``--without-gossip``, same
            for ``mingle`` and ``heartbeat``. Users run with them on, so tests do
            too unless they say why not.
        """
        self.app = app
        self.pool = pool
        self.concurrency = concurrency
        self.hostname = hostname or f"w-{uuid.uuid4().hex[:10]}@localhost"
        self.queues: tuple[str, ...] | None = None if queues is None else tuple(queues)
        self.loglevel = loglevel
        self.extra_env: dict[str, str] = dict(env or {})
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.pythonpath: tuple[str, ...] = tuple(os.fspath(p) for p in pythonpath)
        self.cwd = os.fspath(cwd) if cwd is not None else os.fspath(PROJECT_ROOT)
        self.gossip = gossip
        self.mingle = mingle
        self.heartbeat = heartbeat
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self._owns_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="celery-worker-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: IO[bytes] | None = None
        self._log_offset = 0
        self._known_children: list[psutil.Process] = []

    # -- command line / environment ---------------------------------------

    @property
    def command(self) -> list[str]:
        """Full argv used to start the worker."""
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "worker",
            f"--pool={self.pool}",
            f"--concurrency={self.concurrency}",
            f"--hostname={self.hostname}",
            f"--loglevel={self.loglevel}",
        ]
        if self.queues:
            cmd.append(f"--queues={','.join(self.queues)}")
        if not self.gossip:
            cmd.append("--without-gossip")
        if not self.mingle:
            cmd.append("--without-mingle")
        if not self.heartbeat:
            cmd.append("--without-heartbeat")
        cmd.extend(self.extra_args)
        return cmd

    def environ(self) -> dict[str, str]:
        """Environment for the subprocess (inherits ``os.environ``)."""
        env = dict(os.environ)
        paths = [*self.pythonpath, os.fspath(TESTS_DIR), os.fspath(PROJECT_ROOT)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env

    # -- state --------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Main process id once started."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status of the main process, ``None`` while running."""
        return None if self._proc is None else self._proc.poll()

    def is_alive(self) -> bool:
        """Whether the main worker process is running."""
        return self._proc is not None and self._proc.poll() is None

    def children(self) -> list[psutil.Process]:
        """Live child processes (e.g. prefork pool processes)."""
        if not self.is_alive() or self.pid is None:
            return []
        try:
            found: list[psutil.Process] = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return found

    def log_text(self) -> str:
        """Everything the worker wrote to stdout/stderr so far."""
        return self._read_log(0)

    def log_tail(self, limit: int = 6000) -> str:
        """Last ``limit`` characters of the log."""
        return self.log_text()[-limit:]

    # -- lifecycle -----------------------------------------------------------

    def start(self, wait_ready: bool = True) -> CeleryWorker:
        """Spawn the worker; optionally wait until it logs ``... ready.``."""
        if self.is_alive():
            raise RuntimeError(f"worker {self.hostname} is already running")
        self._close_log()
        self._log_fh = self.log_path.open("ab")
        self._log_offset = self._log_fh.tell()
        self._known_children = []
        self._proc = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.environ(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
        )
        _LIVE.add(self)
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the current run logged readiness; kill it on failure."""
        timeout = self.ready_timeout if timeout is None else timeout
        try:
            self._wait_log(_READY_RE, timeout, since=self._log_offset)
        except RuntimeError:
            self.kill()
            raise
        self._known_children = self.children()

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout: float = 30.0) -> None:
        """Wait until the log contains ``pattern`` (substring or compiled regex)."""
        self._wait_log(pattern, timeout, since=0)

    def stop(self, timeout: float | None = None) -> int | None:
        """Warm shutdown: SIGTERM, wait, then SIGKILL everything on timeout.

        Returns the exit status of the main process (``None`` if never started).
        """
        proc = self._proc
        if proc is None:
            return None
        timeout = self.stop_timeout if timeout is None else timeout
        if proc.poll() is None:
            self._known_children = self.children() or self._known_children
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._kill_leftover_children(grace=min(timeout, 5.0))
        self._close_log()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the main process and all of its children (simulates a crash)."""
        proc = self._proc
        if proc is None:
            return
        victims: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.poll() is None:
                main = psutil.Process(proc.pid)
                victims = [main, *main.children(recursive=True)]
        victims.extend(p for p in self._known_children if p not in victims)
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        proc.wait()
        psutil.wait_procs(victims, timeout=10)
        self._known_children = []
        self._close_log()

    def close(self) -> None:
        """Stop the worker and delete the log file if it was created here."""
        self.stop()
        _LIVE.discard(self)
        if self._owns_log:
            with contextlib.suppress(FileNotFoundError):
                self.log_path.unlink()

    def __enter__(self) -> CeleryWorker:
        if not self.is_alive():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.print_log()
        self.close()

    def print_log(self) -> None:
        """Write the tail of the worker's log to stderr (pytest shows it for a failure)."""
        sys.stderr.write(f"\n--- log of celery worker {self.hostname} ---\n{self.log_tail()}\n")

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else "stopped"
        return f"<CeleryWorker {self.hostname} app={self.app} pool={self.pool} {state}>"

    # -- internals -----------------------------------------------------------

    def _wait_log(self, pattern: str | re.Pattern[str], timeout: float, since: int) -> None:
        deadline = time.monotonic() + timeout
        while True:
            text = self._read_log(since)
            found = pattern.search(text) if isinstance(pattern, re.Pattern) else pattern in text
            if found:
                return
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise RuntimeError(
                    f"worker {self.hostname} exited (status {code}) before logging "
                    f"{pattern!r}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"worker {self.hostname} did not log {pattern!r} within "
                    f"{timeout:.1f}s:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _read_log(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                return fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def _kill_leftover_children(self, grace: float) -> None:
        alive = [p for p in self._known_children if p.is_running()]
        if alive:
            _gone, alive = psutil.wait_procs(alive, timeout=grace)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        if alive:
            psutil.wait_procs(alive, timeout=10)
        self._known_children = []

    def _close_log(self) -> None:
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None


@atexit.register
def _kill_leftover_workers() -> None:
    for worker in list(_LIVE):
        with contextlib.suppress(Exception):
            worker.kill()


@contextlib.contextmanager
def worker_fleet(request: Any) -> Iterator[list[CeleryWorker]]:
    """The workers a test adds to the yielded list are closed afterwards, and their logs
    printed when the test failed (``request`` is pytest's fixture request)."""
    created: list[CeleryWorker] = []
    failed_before = request.session.testsfailed
    try:
        yield created
    finally:
        failed = request.session.testsfailed > failed_before
        for worker in created:
            if failed:
                worker.print_log()
            worker.close()
