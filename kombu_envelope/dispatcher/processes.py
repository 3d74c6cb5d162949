"""Serving one port from several forked dispatcher processes (``--workers N``): the
listening sockets, made before any process starts, and the first process supervising the
others."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Workers", "listen"]

logger = logging.getLogger("kombu_envelope.dispatcher")


def listen(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets listening on ``host:port`` before any process starts (a port in use
    fails here, once): one each with ``SO_REUSEPORT``, so that the kernel spreads the
    connections over the processes, else one shared by all (a process whose event loop is
    free accepts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    sockets = []
    for _ in range(count if reuse_port is not None else 1):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port is not None:
            sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets * (count // len(sockets))


class Workers:
    """``count`` forked processes, the i-th running ``serve(i)`` (each its own Redis
    connections: redis-py opens new ones in a forked process), supervised until SIGINT or
    SIGTERM, which is passed on to them. A process that ends on its own is logged and
    replaced by one with its index, a second later."""

    def __init__(self, serve: Callable[[int], None], count: int) -> None:
        if not hasattr(os, "fork"):
            raise ValueError("--workers above 1 needs os.fork (not on this platform)")
        self.serve, self.count = serve, count
        #: The index of each process running.
        self.pids: dict[int, int] = {}
        self.stopping = False

    def run(self) -> None:
        """Start them, and return once every one has ended after a stop."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._stop)
        for index in range(self.count):
            self._start(index)
        while self.pids:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            index = self.pids.pop(pid, None)
            if index is not None and not self.stopping:
                logger.error("dispatcher process %d ended (%s); starting another", pid,
                             _describe(status))
                time.sleep(1.0)
                if not self.stopping:
                    self._start(index)

    def _start(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (runs in the child, seen through its answers)
            code = 1
            try:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(signum, signal.SIG_DFL)
                self.serve(index)
                code = 0
            finally:
                os._exit(code)
        self.pids[pid] = index

    def _stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
