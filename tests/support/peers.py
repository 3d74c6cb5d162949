"""The Go and Node.js reference peers (``tests/interop/{go,node}``) as subprocesses.

The Node peer is a command line over the Node.js SDK (``sdk/node``, the npm package
``kombu-envelope``), which it installs as a user would (``file:`` dependency).

Go: :func:`build_go_peer` builds the ``envelope-peer`` binary once per test session;
:class:`GoPeer` runs its ``produce`` / ``produce-malformed`` commands and starts
:class:`GoWorker` processes. Node: :class:`NodePeer` runs ``peer.js`` the same way and
starts :class:`NodeWorker` processes. Both peers kill every worker they started in
``close()``; a worker's JSON log lines go to a file.

Tests skip only when a toolchain is missing: :data:`GO` is None, or
:func:`node_unavailable` gives a reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Any

import pytest

from support import wait_for
from support.workers import PROJECT_ROOT

__all__ = [
    "FIRST_BUILD_TIMEOUT_S",
    "GO",
    "GO_DIR",
    "GO_SDK_DIR",
    "LUA_DIR",
    "NODE",
    "NODE_DIR",
    "NODE_PEER",
    "NODE_SDK_DIR",
    "GoPeer",
    "GoWorker",
    "NodePeer",
    "NodeWorker",
    "build_go_peer",
    "go_env",
    "node_unavailable",
]

GO = shutil.which("go")
NODE = shutil.which("node")
#: The Go peer (the interop command); it requires the SDK through a ``replace`` directive.
GO_DIR = PROJECT_ROOT / "tests" / "interop" / "go"
#: The Go SDK (a Go module of its own), whose tests include every conformance vector.
GO_SDK_DIR = PROJECT_ROOT / "sdk" / "go"
NODE_DIR = PROJECT_ROOT / "tests" / "interop" / "node"
NODE_PEER = NODE_DIR / "peer.js"
NODE_SDK_DIR = PROJECT_ROOT / "sdk" / "node"
LUA_DIR = PROJECT_ROOT / "kombu_envelope" / "lua"
#: A first (cold) build compiles go-redis and may take minutes.
FIRST_BUILD_TIMEOUT_S = 180


# --------------------------------------------------------------------------------- Go


def go_env(**extra: str) -> dict[str, str]:
    """The environment of ``go`` commands: this process's, plus ``extra``."""
    env = dict(os.environ)
    env.update(extra)
    return env


_go_binary: Path | None = None


def build_go_peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``envelope-peer`` binary, built on the first call of the session (``go build``).

    Every test module that needs it calls this from its own session fixture; the
    binary is built once whichever module comes first.
    """
    global _go_binary
    if _go_binary is not None and _go_binary.exists():
        return _go_binary
    assert GO is not None
    binary = tmp_path_factory.mktemp("go-peer") / "envelope-peer"
    try:
        built = subprocess.run(
            [GO, "build", "-o", str(binary), "."], cwd=GO_DIR, env=go_env(),
            capture_output=True, text=True, timeout=FIRST_BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"go build took longer than {FIRST_BUILD_TIMEOUT_S} s")
    assert built.returncode == 0, f"go build failed:\n{built.stdout}\n{built.stderr}"
    _go_binary = binary
    return binary


@dataclass
class GoWorker:
    """A running ``envelope-peer worker``; its JSON log lines go to a file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                lines.append({"msg": raw})
        return lines

    def log_tail(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


@dataclass
class GoPeer:
    """Runs the Go peer against one key prefix and queue; kills every worker at the end."""

    binary: Path
    redis_url: str
    prefix: str
    queue: str
    tmp: Path
    workers: list[GoWorker] = field(default_factory=list)

    def common(self) -> list[str]:
        # No --lua-dir: the peer runs the scripts embedded in the SDK, as a user's service does
        # (tests/test_sdk_lua_copies.py keeps those copies equal to kombu_envelope/lua/).
        return ["--redis", self.redis_url, "--prefix", self.prefix, "--queue", self.queue]

    def run(self, command: str, *args: str) -> list[str]:
        done = subprocess.run([str(self.binary), command, *self.common(), *args],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout.split()

    def produce(self, *args: str) -> list[str]:
        return self.run("produce", *args)

    def worker(self, *args: str) -> GoWorker:
        log_path = self.tmp / f"go-worker-{self.queue}-{len(self.workers)}.log"
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            [str(self.binary), "worker", *self.common(), "--lease-ms", "3000",
             "--block-ms", "200", "--backoff-ms", "200", "--max-backoff-ms", "1000", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
        )
        worker = GoWorker(proc, log_path, log_file)
        self.workers.append(worker)
        wait_for(lambda: any(line.get("msg") == "worker started" for line in worker.log_lines())
                 or not worker.alive(), timeout=15, message=worker.log_tail)
        assert worker.alive(), worker.log_tail()
        return worker

    def close(self) -> None:
        for worker in self.workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait()
            worker.log_file.close()


# ------------------------------------------------------------------------------- Node


def _npm_ci(folder: Path, npm: str) -> str | None:
    """``npm ci`` in ``folder``; why it failed, or None."""
    try:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=folder, check=True,
                       capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`npm ci` failed in {folder.relative_to(PROJECT_ROOT)}: {exc}"
    return None


@cache
def node_unavailable() -> str | None:
    """Why the Node SDK and peer cannot run here, or None when they can.

    Installs what is missing with ``npm ci`` (once per process): the SDK's dependencies
    and build (``sdk/node``: ``node_modules`` and ``dist/``), then the peer's.
    """
    if NODE is None:
        return "node is not on PATH"
    needs = [(NODE_SDK_DIR, [NODE_SDK_DIR / "node_modules" / "ioredis",
                             NODE_SDK_DIR / "dist" / "index.cjs"]),
             (NODE_DIR, [NODE_DIR / "node_modules" / "ioredis",
                         NODE_DIR / "node_modules" / "kombu-envelope"])]
    npm = shutil.which("npm")
    for folder, paths in needs:
        if all(path.exists() for path in paths):
            continue
        if npm is None:
            where = folder.relative_to(PROJECT_ROOT)
            return f"{where}/node_modules is missing and npm is not on PATH"
        failed = _npm_ci(folder, npm)
        if failed is not None:
            return failed
    return None


class NodeWorker:
    """A ``node peer.js worker`` subprocess logging JSON lines to a file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, log_file: IO[bytes]) -> None:
        self.proc = proc
        self.log_path = log_path
        self._log_file = log_file

    def lines(self) -> list[dict[str, Any]]:
        """Log lines so far (every one must be JSON)."""
        text = self.log_path.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def log_tail(self) -> str:
        return self.log_path.read_text(encoding="utf-8")[-4000:]

    @property
    def consumer(self) -> str:
        ready = [line for line in self.lines() if line["msg"] == "worker ready"]
        return str(ready[0]["consumer"])

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Kill the process if it still runs and close the log."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._log_file.close()


class NodePeer:
    """Runs the peer's CLI against one Redis URL and key prefix; kills what it started."""

    def __init__(self, redis_url: str, prefix: str, tmp_path: Path) -> None:
        self.redis_url = redis_url
        self.prefix = prefix
        self.tmp_path = tmp_path
        self.workers: list[NodeWorker] = []

    def command(self, name: str, *args: str) -> list[str]:
        assert NODE is not None
        return [NODE, str(NODE_PEER), name, "--redis", self.redis_url, "--prefix", self.prefix,
                *args]

    def run(self, name: str, *args: str, timeout: float = 20.0) -> str:
        """Run a one-shot sub-command; return its stdout."""
        done = subprocess.run(self.command(name, *args), capture_output=True, text=True,
                              timeout=timeout, cwd=NODE_DIR, check=False)
        assert done.returncode == 0, f"peer.js {name} failed ({done.returncode}): {done.stderr}"
        return done.stdout

    def worker(self, queue: str, *args: str) -> NodeWorker:
        """Start a worker and wait until it is ready."""
        log_path = self.tmp_path / f"node-worker-{len(self.workers)}.log"
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            self.command("worker", "--queue", queue, *args),
            stdout=subprocess.DEVNULL, stderr=log_file, stdin=subprocess.DEVNULL, cwd=NODE_DIR,
        )
        worker = NodeWorker(proc, log_path, log_file)
        self.workers.append(worker)

        def ready() -> bool:
            assert proc.poll() is None, f"node worker exited early: {worker.log_tail()}"
            return any(line["msg"] == "worker ready" for line in worker.lines())

        wait_for(ready, timeout=15, message=worker.log_tail)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
