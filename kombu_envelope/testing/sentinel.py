"""Run a private Redis Sentinel group: a primary, replicas and sentinels, on loopback.

:class:`SentinelGroup` is meant for tests, drills and local experiments. Every
process is a :class:`~kombu_envelope.testing.redis_server.PrivateRedisServer` from
the same ``redis-server`` binary, on a free loopback port, with failure detection
tuned small so that a failover takes a few seconds::

    with SentinelGroup() as group:
        app.conf.broker_url = group.url
        app.conf.broker_transport_options = {"master_name": group.master_name}
        group.kill_primary()
        group.wait_for_new_primary()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import redis

from kombu_envelope.testing.redis_server import LOOPBACK, PrivateRedisServer

__all__ = ["SentinelGroup"]

_POLL_S = 0.1


class SentinelGroup:
    """A primary with ``replicas`` replicas, watched by ``sentinels`` sentinels.

    :param master_name: the name the sentinels monitor (``master_name`` option).
    :param down_after_ms: how long a primary must not answer before it counts as down.
    :param failover_timeout_ms: Sentinel's ``failover-timeout``.
    :param password: ``requirepass`` of the data nodes (and ``masterauth``), if any.
    :param sentinel_password: ``requirepass`` of the sentinels, if any.
    :param appendonly: AOF (``appendfsync always``) on the data nodes.
    :param tls_config: ``redis.conf`` lines naming the certificate files (``tls-cert-file``,
        ``tls-key-file``, ``tls-ca-cert-file``, ``tls-auth-clients no``): every process
        then speaks TLS only, replication and the sentinels' links included, and
        :attr:`url` is ``envelopes-sentinel://``.
    :param min_replicas_to_write: ``min-replicas-to-write`` of the data nodes (with
        ``min-replicas-max-lag`` 2 s): a primary cut off from its replicas, like one
        that resumes after a stall, refuses writes (``NOREPLICAS``) instead of taking
        writes its demotion will throw away. 0 turns it off.
    """

    def __init__(self, *, master_name: str = "envelope", replicas: int = 2,
                 sentinels: int = 3, down_after_ms: int = 2000,
                 failover_timeout_ms: int = 3000, password: str | None = None,
                 sentinel_password: str | None = None, appendonly: bool = False,
                 min_replicas_to_write: int = 1, tls_config: Sequence[str] = ()) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError("a Sentinel group needs at least one replica and one sentinel")
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.password = password
        self.sentinel_password = sentinel_password
        self.quorum = sentinels // 2 + 1
        self.tls = bool(tls_config)
        self._tls_config = [*tls_config, "tls-replication yes"] if self.tls else []
        auth = [f"requirepass {password}", f"masterauth {password}"] if password else []
        common = [*auth, *self._tls_config, "repl-diskless-sync yes", "repl-diskless-sync-delay 0",
                  "repl-ping-replica-period 1",
                  f"min-replicas-to-write {min_replicas_to_write}", "min-replicas-max-lag 2"]
        #: Every data node, the first primary first; which is primary changes.
        self.nodes = [PrivateRedisServer(appendonly=appendonly, extra_config=common,
                                         tls=self.tls) for _ in range(1 + replicas)]
        self._common = common
        self.sentinels = [PrivateRedisServer(sentinel=True, tls=self.tls)
                          for _ in range(sentinels)]

    # -- lifecycle --------------------------------------------------------

    def start(self) -> SentinelGroup:
        """Start the primary, its replicas (in sync) and the sentinels (seeing them all)."""
        first, *replicas = self.nodes
        first.start()
        for node in replicas:
            node.extra_config = (*self._common, f"replicaof {LOOPBACK} {first.port}")
            node.start()
        for sentinel in self.sentinels:
            sentinel.extra_config = self._sentinel_config(first.port)
            sentinel.start()
        self._wait(lambda: self._replicas_in_sync(first, len(replicas)), 30,
                   "replicas did not reach the primary")
        self._wait(self._sentinels_see_everyone, 30, "sentinels did not discover the group")
        return self

    def _sentinel_config(self, primary_port: int) -> tuple[str, ...]:
        name = self.master_name
        lines = [
            f"sentinel monitor {name} {LOOPBACK} {primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 2",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {name} {self.password}")
        if self.sentinel_password:
            lines.append(f"requirepass {self.sentinel_password}")
        return (*self._tls_config, *lines)

    def stop(self) -> None:
        """Stop every process and remove their directories."""
        for server in (*self.sentinels, *self.nodes):
            with contextlib.suppress(Exception):
                if server.is_running():
                    os.kill(server.pid or 0, signal.SIGCONT)  # a paused node can shut down
            server.close()

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- where things are -----------------------------------------------

    @property
    def url(self) -> str:
        """``envelope-sentinel://127.0.0.1:P1;envelope-sentinel://127.0.0.1:P2;...``."""
        auth = f":{self.password}@" if self.password else ""
        scheme = "envelopes-sentinel" if self.tls else "envelope-sentinel"
        return ";".join(f"{scheme}://{auth}{LOOPBACK}:{s.port}/0" for s in self.sentinels)

    @property
    def sentinel_kwargs(self) -> dict[str, str] | None:
        """The ``sentinel_kwargs`` option the sentinels' password needs (None without)."""
        return {"password": self.sentinel_password} if self.sentinel_password else None

    def transport_options(self) -> dict[str, object]:
        """``master_name`` and ``sentinel_kwargs``, as ``broker_transport_options``."""
        options: dict[str, object] = {"master_name": self.master_name}
        if self.sentinel_kwargs:
            options["sentinel_kwargs"] = self.sentinel_kwargs
        return options

    def client(self, node: PrivateRedisServer) -> redis.Redis:
        """A plain client on one data node (for checks, never through Sentinel)."""
        return redis.Redis(host=LOOPBACK, port=node.port, password=self.password,
                           socket_timeout=2, socket_connect_timeout=2, **self._ssl)

    def _sentinel_client(self, sentinel: PrivateRedisServer) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=sentinel.port, password=self.sentinel_password,
                           socket_timeout=2, socket_connect_timeout=2, decode_responses=True,
                           **self._ssl)

    @property
    def _ssl(self) -> dict[str, Any]:
        """TLS of the group's own checks: our servers, on loopback, not verified."""
        return {"ssl": True, "ssl_cert_reqs": "none"} if self.tls else {}

    def primary_port(self) -> int | None:
        """The primary's port as a majority of the running sentinels name it (None: none)."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.is_running():
                continue
            with contextlib.suppress(redis.RedisError), \
                    self._sentinel_client(sentinel) as client:
                address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                                 self.master_name)
                if address:
                    port = int(address[1])
                    votes[port] = votes.get(port, 0) + 1
        for port, count in votes.items():
            if count >= self.quorum:
                return port
        return None

    @property
    def primary(self) -> PrivateRedisServer:
        """The data node the sentinels name the primary."""
        port = self.primary_port()
        for node in self.nodes:
            if node.is_running() and node.port == port:
                return node
        raise RuntimeError(f"no running node is the primary the sentinels name ({port})")

    # -- faults ----------------------------------------------------------

    def kill_primary(self) -> PrivateRedisServer:
        """SIGKILL the primary; return it (restart it with ``.start()``: it comes back
        as a replica once the sentinels see it)."""
        node = self.primary
        node.kill()
        return node

    def pause_primary(self) -> PrivateRedisServer:
        """SIGSTOP the primary (a network stall: connections stay open, nothing answers)."""
        node = self.primary
        os.kill(node.pid or 0, signal.SIGSTOP)
        return node

    @staticmethod
    def resume(node: PrivateRedisServer) -> None:
        """SIGCONT a node :meth:`pause_primary` stopped."""
        if node.pid:
            os.kill(node.pid, signal.SIGCONT)

    def wait_for_new_primary(self, old_port: int, timeout: float = 30.0) -> PrivateRedisServer:
        """Wait until the sentinels name another primary and it accepts writes."""
        def promoted() -> bool:
            port = self.primary_port()
            if port is None or port == old_port:
                return False
            node = next(n for n in self.nodes if n.port == port)
            with contextlib.suppress(redis.RedisError), self.client(node) as client:
                return bool(client.info("replication")["role"] == "master")
            return False
        self._wait(promoted, timeout, f"no new primary within {timeout:g} s")
        return self.primary

    def wait_until_replica(self, node: PrivateRedisServer, timeout: float = 30.0) -> None:
        """Wait until ``node`` (a former primary, restarted or resumed) follows the primary."""
        def following() -> bool:
            with contextlib.suppress(redis.RedisError), self.client(node) as client:
                info = client.info("replication")
                return bool(info["role"] == "slave" and info.get("master_link_status") == "up")
            return False
        self._wait(following, timeout, f"node {node.port} did not become a replica")

    # -- waiting ---------------------------------------------------------

    def _replicas_in_sync(self, primary: PrivateRedisServer, count: int) -> bool:
        with contextlib.suppress(redis.RedisError), self.client(primary) as client:
            info = client.info("replication")
            online = [v for k, v in info.items()
                      if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            return len(online) >= count
        return False

    def _sentinels_see_everyone(self) -> bool:
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError), \
                    self._sentinel_client(sentinel) as client:
                master = client.execute_command("SENTINEL", "MASTER", self.master_name)
                fields = dict(zip(master[::2], master[1::2])) if isinstance(master, list) \
                    else master
                if (int(fields["num-slaves"]) < len(self.nodes) - 1
                        or int(fields["num-other-sentinels"]) < len(self.sentinels) - 1):
                    return False
                continue
            return False
        return True

    @staticmethod
    def _wait(check: object, timeout: float, failure: str) -> None:
        assert callable(check)
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            time.sleep(_POLL_S)
