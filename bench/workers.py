"""Real ``celery worker`` subprocesses running :mod:`bench.celery_app`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil

from bench.celery_app import run_key
from bench.core import RedisClient

#: Repository root: the workers import ``bench`` and ``celery_ext`` from here.
ROOT = Path(__file__).resolve().parent.parent


class WorkerError(RuntimeError):
    """A worker exited or did not get ready in time."""


class Worker:
    """One ``celery -A bench.celery_app worker`` process (plus its pool processes)."""

    def __init__(
        self,
        *,
        broker_url: str,
        redis_url: str,
        run: str,
        queue: str,
        pool: str = "solo",
        concurrency: int = 1,
        prefetch: int = 4,
        transport_options: Mapping[str, Any] | None = None,
        loglevel: str = "WARNING",
        kill_on_exit: bool = False,
    ) -> None:
        self.broker_url = broker_url
        self.redis_url = redis_url
        self.run = run
        self.queue = queue
        self.pool = pool
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.transport_options = dict(transport_options or {})
        self.loglevel = loglevel
        #: SIGKILL instead of a warm shutdown on close (when what it holds no longer matters).
        self.kill_on_exit = kill_on_exit
        self.hostname = f"bench-{uuid.uuid4().hex[:8]}@localhost"
        self.started_at: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        fd, name = tempfile.mkstemp(prefix="bench-worker-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)

    @property
    def command(self) -> list[str]:
        """The worker's argv."""
        return [
            sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker",
            f"--pool={self.pool}", f"--concurrency={self.concurrency}",
            f"--hostname={self.hostname}", f"--loglevel={self.loglevel}",
            # The drain is timed without control traffic, the same for every broker:
            # gossip, mingle and heartbeats would add broker round trips that differ
            # between transports and blur the comparison.
            f"--queues={self.queue}", "--without-gossip", "--without-mingle",
            "--without-heartbeat",
        ]

    def environ(self) -> dict[str, str]:
        """The worker's environment."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(
            BENCH_BROKER_URL=self.broker_url,
            BENCH_REDIS_URL=self.redis_url,
            BENCH_RUN=self.run,
            BENCH_QUEUE=self.queue,
            BENCH_PREFETCH=str(self.prefetch),
            BENCH_TRANSPORT_OPTIONS=json.dumps(self.transport_options),
            PYTHONUNBUFFERED="1",
        )
        return env

    @property
    def pid(self) -> int | None:
        """Main process id once started."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> Worker:
        """Spawn the worker (without waiting for it)."""
        self._log = self.log_path.open("ab")
        self.started_at = time.time()
        self._proc = subprocess.Popen(
            self.command, cwd=ROOT, env=self.environ(), stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        return self

    def check_alive(self) -> None:
        """Raise :class:`WorkerError` (with the log) if the worker has exited."""
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            raise WorkerError(f"worker exited with status {code}:\n{self.log_tail()}")

    def wait_ready(self, client: RedisClient, timeout: float = 60.0) -> float:
        """Wait until the worker announced readiness; return that time (epoch seconds)."""
        key = run_key(self.run, f"ready:{self.hostname}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = client.get(key)
            if value is not None:
                return float(value)
            self.check_alive()
            time.sleep(0.02)
        raise WorkerError(f"worker not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def processes(self) -> list[psutil.Process]:
        """The main process and its children."""
        if self._proc is None or self._proc.poll() is not None:
            return []
        try:
            main = psutil.Process(self._proc.pid)
            return [main, *main.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_bytes(self) -> int:
        """Resident memory of the main process and its children."""
        total = 0
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        return total

    def kill(self) -> None:
        """SIGKILL the main process and every pool process at once (a crash)."""
        victims = self.processes()
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        if self._proc is not None:
            self._proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown; SIGKILL whatever is left after ``timeout`` seconds."""
        if self._proc is not None and self._proc.poll() is None:
            children = self.processes()[1:]
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
            _gone, alive = psutil.wait_procs(children, timeout=5)
            for proc in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the worker's output."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the worker and remove its log."""
        if self.kill_on_exit:
            self.kill()
        self.stop()
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            sys.stderr.write(f"\n--- worker log ---\n{self.log_tail()}\n")
        self.close()
