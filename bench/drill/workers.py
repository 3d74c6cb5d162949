"""The drill's worker processes, each in a process group of its own.

A Python worker is a ``celery worker`` with Celery's defaults (mingle, gossip and
heartbeat on) and the prefork pool; a Go, Node.js or Java worker is its interop peer's
``drill`` command (:mod:`bench.drill.peers`). A worker is started in a new session, so
its main process and every process it forks share one process group, and
:meth:`DrillWorker.kill` SIGKILLs them all with one ``killpg``: a host that dies, not a
process that is told to stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from bench.drill.app import QUEUE
from bench.drill.config import PYTHON
from bench.drill.peers import Peers

#: Repository root: workers import ``bench`` and ``celery_ext`` from here.
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PeerSpec:
    """What a Go, Node.js or Java worker is started with."""

    peers: Peers
    #: The broker's Redis URL in the SDKs' form (redis://, redis-sentinel://, redis-cluster://).
    url: str
    prefix: str
    lease_ms: int
    wait_replicas: int


class DrillWorker:
    """One worker's process group: ``celery -A bench.drill.app worker``, or a peer's."""

    def __init__(self, hostname: str, *, broker_url: str, transport_options: dict[str, Any],
                 ledger_url: str, run: str, concurrency: int, log_dir: Path,
                 queues: tuple[str, ...] = (QUEUE,), language: str = PYTHON,
                 peer: PeerSpec | None = None) -> None:
        if language != PYTHON and peer is None:
            raise ValueError(f"a {language} worker needs its PeerSpec")
        self.hostname = hostname
        self.language = language
        self.peer = peer
        self.queues = queues
        self.broker_url = broker_url
        self.transport_options = transport_options
        self.ledger_url = ledger_url
        self.run = run
        self.concurrency = concurrency
        self.log_path = log_dir / f"{hostname.split('@', 1)[0]}.log"
        self.started_at: float | None = None
        self.killed_at: float | None = None
        #: When the drill saw that it had exited on its own.
        self.exited_at: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def command(self) -> tuple[list[str], Path]:
        """The worker's argv and working directory. Celery: its defaults but for the pool,
        its size and the queues; a peer: the same concurrency, lease and queues."""
        if self.language == PYTHON or self.peer is None:
            return [sys.executable, "-m", "celery", "-A", "bench.drill.app", "worker",
                    "--pool=prefork", f"--concurrency={self.concurrency}",
                    f"--hostname={self.hostname}", "--loglevel=INFO",
                    f"--queues={','.join(self.queues)}"], ROOT
        spec = self.peer
        return spec.peers.argv(self.language, url=spec.url, prefix=spec.prefix,
                               queues=self.queues, hostname=self.hostname,
                               lease_ms=spec.lease_ms, concurrency=self.concurrency,
                               wait_replicas=spec.wait_replicas)

    def environ(self) -> dict[str, str]:
        """The worker's environment."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(DRILL_BROKER_URL=self.broker_url,
                   DRILL_TRANSPORT_OPTIONS=json.dumps(self.transport_options),
                   DRILL_LEDGER_URL=self.ledger_url, DRILL_RUN=self.run, PYTHONUNBUFFERED="1")
        return env

    @property
    def pid(self) -> int | None:
        """Main process id (also the process group id) once started."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> DrillWorker:
        """Spawn the worker in a new session, without waiting for it."""
        self._log = self.log_path.open("ab")
        self.started_at = time.time()
        argv, cwd = self.command
        self._proc = subprocess.Popen(argv, cwd=cwd, env=self.environ(),
                                      stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def exit_code(self) -> int | None:
        """The main process's exit status, None while it runs."""
        return None if self._proc is None else self._proc.poll()

    def group(self) -> list[psutil.Process]:
        """Every live process of the worker's group (main and pool, zombies left out)."""
        pid = self.pid
        if pid is None:
            return []
        members = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):  # gone while we looked
                if os.getpgid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                    members.append(proc)
        return members

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL the whole process group; wait until it is gone. Returns processes hit."""
        pid = self.pid
        if pid is None:
            return 0
        hit = len(self.group())
        self.killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        assert self._proc is not None
        self._proc.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while survivors := self.group():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.hostname}: processes {[p.pid for p in survivors]} "
                                   "survived SIGKILL")
            time.sleep(0.02)
        self._close_log()
        return hit

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process); see :meth:`stop`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown; SIGKILL the group if it is not over after ``timeout`` seconds."""
        self.terminate()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=timeout)
            if self.group():
                self.kill()
        self._close_log()

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the worker's output."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __repr__(self) -> str:
        return (f"<DrillWorker {self.language} {self.hostname} pid={self.pid} "
                f"exit={self.exit_code()}>")
