"""Run a private, throw-away Redis Cluster: three primaries with one replica each.

:class:`PrivateRedisCluster` starts six :class:`PrivateRedisServer` processes on
free loopback ports with ``cluster-enabled yes``, joins them with ``redis-cli
--cluster create ... --cluster-replicas 1 --cluster-yes`` and waits until every
node reports ``cluster_state:ok``. It can then break the cluster the way
production does: SIGKILL a primary, run ``CLUSTER FAILOVER`` on a replica,
stall a primary (SIGSTOP), or move one slot (a queue's) to another primary::

    with PrivateRedisCluster() as cluster:
        app.conf.broker_url = cluster.url
        cluster.move_slot(cluster.keyslot("envelope:{orders}:normal"), to=cluster.primaries()[1])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis

from kombu_envelope.testing.redis_server import LOOPBACK, PrivateRedisServer, _free_port

__all__ = ["ClusterNodeInfo", "PrivateRedisCluster", "find_redis_cli_binary"]

#: Redis Cluster's bus listens on the data port plus this offset.
_BUS_OFFSET = 10000
_SLOTS = 16384


def find_redis_cli_binary(server_binary: str | None = None) -> str:
    """The ``redis-cli`` next to ``server_binary``, else the one on PATH."""
    if server_binary:
        sibling = os.path.join(os.path.dirname(server_binary), "redis-cli")
        if os.access(sibling, os.X_OK):
            return sibling
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("no redis-cli binary found (apt-get install redis-tools)")
    return found


def _cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free as well."""
    while True:
        port = _free_port()
        if port + _BUS_OFFSET >= 65536:
            continue
        try:
            with contextlib.closing(socket.socket()) as sock:
                sock.bind((LOOPBACK, port + _BUS_OFFSET))
        except OSError:
            continue
        return port


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One node as ``CLUSTER NODES`` shows it."""

    node_id: str
    port: int
    primary: bool
    #: Node id of the primary a replica follows ("" for a primary).
    primary_id: str
    slots: tuple[tuple[int, int], ...]
    failed: bool


class PrivateRedisCluster:
    """Six private ``redis-server`` processes forming one Redis Cluster on loopback."""

    def __init__(self, *, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1500,
                 startup_timeout: float = 60.0, appendonly: bool = False) -> None:
        """Configure (but do not start) a cluster.

        :param node_timeout_ms: ``cluster-node-timeout``: how long a silent primary
            stays a primary before its replica takes over (a failover takes about
            twice that).
        :param appendonly: AOF on every node (``appendfsync always``).
        """
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout = startup_timeout
        self.replicas_per_primary = replicas
        self.servers = [
            PrivateRedisServer(port=_cluster_port(), appendonly=appendonly, extra_config=[
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-node-timeout {node_timeout_ms}",
                # A replica takes over however long it was cut off (drills stall nodes).
                "cluster-replica-validity-factor 0",
                "cluster-require-full-coverage yes",
                "cluster-allow-reads-when-down no",
            ])
            for _ in range(primaries * (1 + replicas))
        ]
        self._stopped: set[int] = set()

    # -- addresses --------------------------------------------------------

    @property
    def ports(self) -> list[int]:
        """Data ports of every node, primaries first as created."""
        return [server.port for server in self.servers]

    @property
    def url(self) -> str:
        """``envelope-cluster://127.0.0.1:P1;envelope-cluster://127.0.0.1:P2;...``."""
        return ";".join(f"envelope-cluster://{LOOPBACK}:{port}" for port in self.ports)

    def server(self, port: int) -> PrivateRedisServer:
        """The server listening on ``port``."""
        return next(server for server in self.servers if server.port == port)

    def client(self, port: int) -> redis.Redis:
        """A plain client of one node (close it after use)."""
        return redis.Redis(host=LOOPBACK, port=port, socket_timeout=5)

    def _command(self, port: int, *args: str | int) -> object:
        with contextlib.closing(self.client(port)) as client:
            return client.execute_command(*args)

    # -- lifecycle --------------------------------------------------------

    def start(self) -> PrivateRedisCluster:
        """Start every node, create the cluster and wait until it is ready."""
        for server in self.servers:
            server.start()
        cli = find_redis_cli_binary(self.servers[0].binary)
        subprocess.run(
            [cli, "--cluster", "create", *(f"{LOOPBACK}:{port}" for port in self.ports),
             "--cluster-replicas", str(self.replicas_per_primary), "--cluster-yes"],
            stdin=subprocess.DEVNULL, capture_output=True, check=True,
            timeout=self.startup_timeout,
        )
        self.wait_ok()
        self._wait_replicas_known()
        return self

    def _wait_replicas_known(self) -> None:
        """Wait until every node lists every replica (they join after the slots) and every
        primary's replicas are in sync (``WAIT`` counts them from then on)."""
        expected = len(self.servers) - len(self.servers) // (1 + self.replicas_per_primary)
        deadline = time.monotonic() + self.startup_timeout
        while any(sum(1 for node in self.nodes(port) if node.primary_id) != expected
                  for port in self.ports) or not self._replicas_online():
            if time.monotonic() >= deadline:
                raise RuntimeError("the replicas did not join the cluster in time")
            time.sleep(0.05)

    def _replicas_online(self) -> bool:
        for port in self.primaries():
            with contextlib.closing(self.client(port)) as client:
                info: dict[str, Any] = client.info("replication")
            online = [name for name, value in info.items() if name.startswith("slave")
                      and isinstance(value, dict) and value.get("state") == "online"]
            if len(online) < self.replicas_per_primary:
                return False
        return True

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for server in self.servers:
            self.resume(server.port)
            server.close()

    def __enter__(self) -> PrivateRedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- topology ---------------------------------------------------------

    def nodes(self, via: int | None = None) -> list[ClusterNodeInfo]:
        """``CLUSTER NODES`` as seen by node ``via`` (default: any running node)."""
        port = via if via is not None else self._any_live_port()
        raw = self._command(port, "CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        nodes = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 8:
                continue
            slots = []
            for item in parts[8:]:
                if item.startswith("["):
                    continue  # a slot being migrated or imported
                low, _, high = item.partition("-")
                slots.append((int(low), int(high or low)))
            flags = parts[2].split(",")
            nodes.append(ClusterNodeInfo(
                node_id=parts[0], port=int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                primary="master" in flags, primary_id="" if parts[3] == "-" else parts[3],
                slots=tuple(slots), failed="fail" in flags or "fail?" in flags))
        return nodes

    def primaries(self) -> list[int]:
        """Ports of the primaries that serve slots, in slot order."""
        serving = [node for node in self.nodes() if node.primary and node.slots
                   and not node.failed]
        return [node.port for node in sorted(serving, key=lambda node: node.slots[0])]

    def replicas_of(self, primary_port: int) -> list[int]:
        """Ports of the replicas following the primary on ``primary_port``."""
        nodes = self.nodes()
        primary = next(node for node in nodes if node.port == primary_port)
        return [node.port for node in nodes if node.primary_id == primary.node_id
                and not node.failed]

    def keyslot(self, key: str) -> int:
        """``CLUSTER KEYSLOT key``."""
        reply: Any = self._command(self._any_live_port(), "CLUSTER", "KEYSLOT", key)
        return int(reply)

    def owner_of(self, slot: int) -> int:
        """Port of the primary that serves ``slot``."""
        for node in self.nodes():
            if node.primary and not node.failed and any(
                    low <= slot <= high for low, high in node.slots):
                return node.port
        raise RuntimeError(f"no primary serves slot {slot}")

    # -- faults -----------------------------------------------------------

    def kill(self, port: int, wait: bool = True) -> None:
        """SIGKILL the node on ``port``; with ``wait``, until the cluster is ok again."""
        self.server(port).kill()
        self._stopped.add(port)
        if wait:
            self.wait_ok(failover_of=port)

    def restart(self, port: int) -> None:
        """Start a killed node again (it rejoins, as a replica once it was replaced)."""
        self.server(port).start()
        self._stopped.discard(port)
        self.wait_ok()

    def failover(self, replica_port: int, timeout: float = 30.0) -> None:
        """``CLUSTER FAILOVER`` on a replica; return once it serves its primary's slots."""
        self._command(replica_port, "CLUSTER", "FAILOVER")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            me = next(node for node in self.nodes(replica_port) if node.port == replica_port)
            if me.primary and me.slots:
                self.wait_ok()
                return
            time.sleep(0.05)
        raise RuntimeError(f"replica {replica_port} did not take over within {timeout}s")

    def pause(self, port: int) -> None:
        """SIGSTOP the node on ``port``: a network stall, as its peers see it."""
        pid = self.server(port).pid
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self._stopped.add(port)

    def resume(self, port: int) -> None:
        """SIGCONT a node stopped by :meth:`pause`."""
        server = self.server(port)
        if port in self._stopped and server.is_running() and server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
            self._stopped.discard(port)

    def move_slot(self, slot: int, to: int, batch: int = 100) -> None:
        """Reshard ``slot`` (with its keys) to the primary on port ``to``, while clients run.

        The documented sequence: ``SETSLOT IMPORTING`` on the target, ``MIGRATING`` on
        the source, ``MIGRATE ... KEYS`` in batches (clients get ``ASK`` meanwhile),
        then ``SETSLOT NODE`` on every primary (clients get ``MOVED``).
        """
        source = self.owner_of(slot)
        if source == to:
            return
        nodes = {node.port: node for node in self.nodes()}
        target_id, source_id = nodes[to].node_id, nodes[source].node_id
        self._command(to, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self._command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        with contextlib.closing(self.client(source)) as client:
            while True:
                keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
                if not keys:
                    break
                client.execute_command("MIGRATE", LOOPBACK, to, "", 0, 5000, "KEYS", *keys)
        for port in [to, source, *(p for p in self.primaries() if p not in (to, source))]:
            self._command(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_ok()

    # -- waiting ----------------------------------------------------------

    def wait_ok(self, failover_of: int | None = None, timeout: float | None = None) -> None:
        """Wait until every running node says ``cluster_state:ok`` and agrees that every
        slot is served (by a primary other than ``failover_of``)."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while True:
            if self._is_ok(failover_of):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok in time")
            time.sleep(0.05)

    def _is_ok(self, failover_of: int | None) -> bool:
        for port in self._live_ports():
            try:
                info = self._command(port, "CLUSTER", "INFO")
                nodes = self.nodes(port)
            except redis.RedisError:
                return False
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            served = sum(high - low + 1 for node in nodes if node.primary and not node.failed
                         and node.port != failover_of for low, high in node.slots)
            if served != _SLOTS:
                return False
        return True

    def _live_ports(self) -> list[int]:
        return [server.port for server in self.servers
                if server.is_running() and server.port not in self._stopped]

    def _any_live_port(self) -> int:
        ports = self._live_ports()
        if not ports:
            raise RuntimeError("no node of the cluster is running")
        return ports[0]
