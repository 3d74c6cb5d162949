"""``--workers N``: N forked dispatcher processes on one port, supervised by the first
(each with its own Redis connections after the fork)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from support import wait_for

from kombu_envelope.dispatcher.config import DispatcherConfig
from kombu_envelope.testing.dispatcher import DispatcherProcess

#: Connections opened at once: SO_REUSEPORT spreads them by a hash, so with 16 the chance
#: that one process gets them all is 2 in 65,536.
CONNECTIONS = 16


def children(server: DispatcherProcess) -> list[psutil.Process]:
    assert server.process is not None
    return psutil.Process(server.process.pid).children()


def healthy(connection: http.client.HTTPConnection) -> None:
    """``GET /healthz``: the process that holds ``connection`` reaches Redis."""
    connection.request("GET", "/healthz")
    answer = connection.getresponse()
    body = json.loads(answer.read())
    assert answer.status == 200 and body["redis"] == "ok", body


def established(process: psutil.Process, port: int) -> int:
    return sum(1 for c in process.net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)


def test_the_processes_share_the_port_and_a_killed_one_is_replaced(redis_url: str) -> None:
    with DispatcherProcess(redis_url, extra_args=["--workers", "2"]) as server:
        first = children(server)
        assert len(first) == 2
        connections = [http.client.HTTPConnection("127.0.0.1", server.port)
                       for _ in range(CONNECTIONS)]
        for connection in connections:
            healthy(connection)
        # Each process holds some of the connections: the kernel spread them.
        assert all(established(child, server.port) > 0 for child in first)
        for connection in connections:
            connection.close()

        first[0].send_signal(signal.SIGKILL)
        replaced = wait_for(lambda: (now := children(server)) and len(now) == 2
                            and first[0].pid not in {c.pid for c in now} and now,
                            timeout=15, message="the killed process replaced")
        assert first[1].pid in {c.pid for c in replaced}
        for _ in range(CONNECTIONS):
            healthy(http.client.HTTPConnection("127.0.0.1", server.port))
        assert "ended (signal SIGKILL); starting another" in server.log()

        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(15) == 0
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE
                       for child in replaced)


def test_a_port_in_use_is_refused_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        ran = subprocess.run([sys.executable, "-m", "kombu_envelope.dispatcher", "--url",
                              "envelope://127.0.0.1:1", "--port", str(port), "--workers", "2"],
                             capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in ran.stderr, ran.stderr
    assert time.monotonic() - started < 30  # refused, not retried


def test_each_process_enforces_its_share_of_the_rate() -> None:
    config = DispatcherConfig(rate_per_s=100, rate_burst=7, workers=2)
    assert config.rate_per_process == (50.0, 3)
    assert DispatcherConfig(rate_burst=1, workers=4).rate_per_process[1] == 1
    with pytest.raises(ValueError, match="workers"):
        DispatcherConfig(workers=0)
