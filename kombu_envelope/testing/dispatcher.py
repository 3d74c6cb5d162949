"""Run the dispatcher in a process of its own on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from kombu_envelope.testing.redis_server import LOOPBACK, _free_port


class DispatcherProcess:
    """``python -m kombu_envelope.dispatcher`` on ``redis_url`` with ``tokens``
    (``[{"name", "scope", "token"}]``; none: no authentication) and transport ``options``."""

    def __init__(self, redis_url: str, tokens: list[dict[str, str]] | None = None,
                 options: dict[str, Any] | None = None, extra_args: list[str] | None = None,
                 start_timeout_s: float = 20.0) -> None:
        self.redis_url = redis_url
        self.tokens = tokens or []
        self.options = options or {}
        self.extra_args = extra_args or []
        self.start_timeout_s = start_timeout_s
        self.port = _free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="dispatcher-")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> DispatcherProcess:
        """Start it and wait until ``/healthz`` answers."""
        args = [sys.executable, "-m", "kombu_envelope.dispatcher", "--url", self.redis_url,
                "--host", LOOPBACK, "--port", str(self.port), *self.extra_args]
        if self.tokens:
            path = Path(self._dir.name) / "tokens.json"
            path.write_text(json.dumps(self.tokens), encoding="utf-8")
            args += ["--tokens-file", str(path)]
        for name, value in self.options.items():
            args += ["-o", f"{name}={json.dumps(value)}"]
        log = open(Path(self._dir.name) / "log", "wb")  # noqa: SIM115 (kept while it runs)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KOMBU_ENVELOPE_DISPATCHER")}
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the dispatcher exited at start:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the dispatcher did not answer within {self.start_timeout_s} s:\n"
                           f"{self.log()}")

    def log(self) -> str:
        """What the process wrote so far."""
        try:
            return (Path(self._dir.name) / "log").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> DispatcherProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        self._dir.cleanup()
