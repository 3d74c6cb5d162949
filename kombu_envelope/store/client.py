"""The one place that builds Redis clients: one Redis, Sentinel-managed, or a Cluster.

Where Redis is comes from a URL (or a kombu connection, which parsed one):

* ``envelope://[user:password@]host[:port][/db]``: one Redis; ``envelopes://`` over TLS
  (``redis://`` and ``rediss://`` are read the same way, for tools outside kombu).
* ``envelope-sentinel://[user:password@]host[:26379][/db];envelope-sentinel://host2...``:
  the primary of the Sentinel group named by the ``master_name`` option, the one a
  majority of the listed sentinels name (kombu's ``sentinel://`` convention; see
  :mod:`kombu_envelope.store.sentinel`).
  ``envelopes-sentinel://`` connects to the data nodes over TLS; the sentinels'
  own credentials and TLS come from the ``sentinel_kwargs`` option.
* ``envelope-cluster://[user:password@]host[:port];envelope-cluster://host2...``: a Redis
  Cluster, found from any of the listed seed nodes; ``envelopes-cluster://`` over TLS.
  A Cluster has only database 0.

TLS options come from kombu's ``ssl`` argument (Celery's ``broker_use_ssl``).
:func:`new_client` is the one builder: every front end (the kombu transport, Celery's
bootsteps and commands, the standalone scheduler, the demo) calls it, so the three kinds
of deployment share one implementation above the client.
"""

from __future__ import annotations

import ssl as ssl_module
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from kombu_envelope.errors import InvalidTransportOption
from kombu_envelope.settings import Settings
from kombu_envelope.store.cluster import EnvelopeCluster
from kombu_envelope.store.outages import OutageRetry
from kombu_envelope.store.sentinel import MajoritySentinel, PrimaryConnection, PrimarySSLConnection

__all__ = [
    "DEFAULT_PORTS", "SCHEMES", "AnyRedis", "Deployment", "RedisEndpoint", "client_for_url",
    "close_client", "new_client",
]

#: What :func:`new_client` builds: both speak every command the store sends.
AnyRedis = redis.Redis | RedisCluster


class Deployment(str, Enum):
    """How Redis is deployed."""

    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


#: URL scheme -> (deployment, TLS).
SCHEMES: dict[str, tuple[Deployment, bool]] = {
    "envelope": (Deployment.SINGLE, False),
    "envelopes": (Deployment.SINGLE, True),
    "redis": (Deployment.SINGLE, False),
    "rediss": (Deployment.SINGLE, True),
    "envelope-sentinel": (Deployment.SENTINEL, False),
    "envelopes-sentinel": (Deployment.SENTINEL, True),
    "envelope-cluster": (Deployment.CLUSTER, False),
    "envelopes-cluster": (Deployment.CLUSTER, True),
}
#: Port of a node a URL names without one.
DEFAULT_PORTS = {Deployment.SINGLE: 6379, Deployment.SENTINEL: 26379, Deployment.CLUSTER: 6379}

_SSL_NAMES = {
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
    "ssl_ca_path", "ssl_ca_data", "ssl_password",
}
_CERT_REQS = {
    ssl_module.CERT_NONE: "none", ssl_module.CERT_OPTIONAL: "optional",
    ssl_module.CERT_REQUIRED: "required",
}


@dataclass(frozen=True)
class RedisEndpoint:
    """Where Redis is: the deployment, its nodes (sentinels, seeds) and the credentials."""

    deployment: Deployment
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    #: redis-py ``ssl_*`` keyword arguments.
    ssl: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.nodes:
            raise InvalidTransportOption({"url": "names no Redis host"})
        if self.deployment is Deployment.CLUSTER and self.db != 0:
            raise InvalidTransportOption(
                {"url": f"a Redis Cluster has only database 0, not {self.db}"})

    @classmethod
    def from_url(cls, url: str, ssl: Mapping[str, Any] | bool | None = None) -> RedisEndpoint:
        """The endpoint of a URL, or of a ``;``-separated list of them (sentinels, seeds)."""
        parts = [urlsplit(part.strip()) for part in url.split(";") if part.strip()]
        if not parts:
            raise InvalidTransportOption({"url": "is empty"})
        schemes = {part.scheme for part in parts}
        if len(schemes) != 1 or parts[0].scheme not in SCHEMES:
            raise InvalidTransportOption({"url": (
                f"scheme must be one of {', '.join(sorted(SCHEMES))}, the same in every "
                f"part of a ';' list, not {', '.join(sorted(schemes))}")})
        deployment, tls = SCHEMES[parts[0].scheme]
        if deployment is Deployment.SINGLE and len(parts) > 1:
            raise InvalidTransportOption({"url": (
                "names several hosts: use envelope-sentinel:// for a Sentinel group or "
                "envelope-cluster:// for a Cluster")})
        first = parts[0]
        return cls(
            deployment=deployment,
            nodes=tuple((part.hostname or "localhost", _port(part, deployment)) for part in parts),
            db=database_number(first.path),
            username=unquote(first.username) if first.username else None,
            password=unquote(first.password) if first.password else None,
            tls=tls or bool(ssl),
            ssl=_ssl_kwargs(ssl),
        )

    @classmethod
    def from_conninfo(cls, conninfo: Any) -> RedisEndpoint:
        """The endpoint of a kombu Connection (its URL, ``;`` alternates and ``ssl``)."""
        scheme = getattr(conninfo, "transport_cls", None)
        if not isinstance(scheme, str) or scheme not in SCHEMES:
            # A transport named explicitly (Connection(url, transport=...)): the URLs
            # kombu keeps in ``alt`` still say which deployment they name.
            scheme = next((urlsplit(url).scheme for url in getattr(conninfo, "alt", None) or ()
                           if isinstance(url, str) and "://" in url), None)
        deployment, tls = SCHEMES.get(scheme, (Deployment.SINGLE, False)) \
            if isinstance(scheme, str) else (Deployment.SINGLE, False)
        hosts = [(conninfo.hostname or "localhost", conninfo.port or DEFAULT_PORTS[deployment])]
        for alternate in getattr(conninfo, "alt", None) or ():
            part = urlsplit(alternate)
            node = (part.hostname or "localhost", _port(part, deployment))
            if part.scheme in SCHEMES and node not in hosts:
                hosts.append(node)
        if deployment is Deployment.SINGLE:
            hosts = hosts[:1]  # kombu's own failover alternates are not Redis nodes of ours
        return cls(
            deployment=deployment, nodes=tuple(hosts),
            db=database_number(conninfo.virtual_host),
            username=conninfo.userid or None, password=conninfo.password or None,
            tls=tls or bool(conninfo.ssl), ssl=_ssl_kwargs(conninfo.ssl),
        )


def _port(part: Any, deployment: Deployment) -> int:
    try:
        return part.port or DEFAULT_PORTS[deployment]
    except ValueError as exc:  # urlsplit refuses a port that is not a number
        raise InvalidTransportOption({"url": f"port of {part.netloc!r}: {exc}"}) from exc


def _ssl_kwargs(ssl: Mapping[str, Any] | bool | None) -> dict[str, Any]:
    if not isinstance(ssl, Mapping):
        return {}
    return {name: _CERT_REQS.get(value, value) for name, value in ssl.items()
            if name in _SSL_NAMES}


def database_number(virtual_host: str | None) -> int:
    """The Redis database number named by kombu's virtual host ('', '/', '3', '/3')."""
    text = (virtual_host or "").strip("/")
    if not text:
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise InvalidTransportOption(
            {"url": f"database number must be an integer, not {virtual_host!r}"}) from exc


def connection_kwargs(endpoint: RedisEndpoint, settings: Settings) -> dict[str, Any]:
    """Keyword arguments of every data-node connection (no host, port or database)."""
    kwargs: dict[str, Any] = {
        "username": endpoint.username,
        "password": endpoint.password,
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.socket_connect_timeout,
        "socket_keepalive": settings.socket_keepalive,
        "socket_keepalive_options": settings.socket_keepalive_options,
        "retry_on_timeout": settings.retry_on_timeout,
        "health_check_interval": settings.health_check_interval,
        "client_name": settings.client_name,
        "protocol": 2,  # replies are parsed as RESP2 arrays whatever the redis-py default
        "retry": OutageRetry(settings.outage_tolerance_s),
    }
    if endpoint.tls:
        kwargs.update(endpoint.ssl)
    kwargs.update(settings.connection_kwargs)
    return kwargs


def new_client(endpoint: RedisEndpoint, settings: Settings) -> AnyRedis:
    """A redis-py client: ``Redis`` (Sentinel-managed or not) or ``RedisCluster``."""
    kwargs = connection_kwargs(endpoint, settings)
    if endpoint.deployment is Deployment.CLUSTER:
        if endpoint.tls:
            kwargs["ssl"] = True
        # redis-py refuses a per-node retry on a Cluster: its own tries follow MOVED and
        # ASK at once, and EnvelopeCluster waits out a failover on the outage clock.
        kwargs.pop("retry")
        kwargs.pop("retry_on_timeout")  # covered: EnvelopeCluster retries timeouts too
        seeds = [ClusterNode(host, port) for host, port in endpoint.nodes]
        return EnvelopeCluster(startup_nodes=seeds, tolerance_s=settings.outage_tolerance_s,
                               **{"max_connections": settings.max_connections or 2**31,
                                  **kwargs})
    if endpoint.deployment is Deployment.SENTINEL:
        if settings.master_name is None:
            raise InvalidTransportOption({"master_name": (
                "must name the Sentinel group's primary (the name in `sentinel monitor "
                "<name> ...`) for an envelope-sentinel:// URL")})
        if endpoint.tls:
            kwargs["ssl"] = True
        sentinel = MajoritySentinel(list(endpoint.nodes), sentinel_kwargs=settings.sentinel_kwargs,
                            min_other_sentinels=settings.min_other_sentinels,
                            db=endpoint.db, **kwargs)
        primary: redis.Redis = sentinel.master_for(
            settings.master_name, max_connections=settings.max_connections,
            connection_class=PrimarySSLConnection if endpoint.tls else PrimaryConnection)
        return primary
    (host, port), = endpoint.nodes
    if endpoint.tls:
        kwargs["connection_class"] = redis.SSLConnection
    pool = redis.ConnectionPool(host=host, port=port, db=endpoint.db,
                                **{"max_connections": settings.max_connections, **kwargs})
    return redis.Redis(connection_pool=pool)


def client_for_url(url: str, settings: Settings | None = None,
                   ssl: Mapping[str, Any] | bool | None = None) -> AnyRedis:
    """:func:`new_client` for a URL (tools and front ends outside kombu)."""
    return new_client(RedisEndpoint.from_url(url, ssl), settings or Settings())



def close_client(client: AnyRedis) -> None:
    """Close every connection ``client`` opened (its pool's, or each Cluster node's)."""
    if isinstance(client, redis.Redis):
        client.connection_pool.disconnect()
    else:
        client.close()
