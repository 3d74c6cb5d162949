"""Redis connection parameters from a kombu connection.

``envelope://[user:password@]host[:port][/db]`` connects over TCP and
``envelopes://...`` over TLS (TLS options come from kombu's ``ssl`` argument,
Celery's ``broker_use_ssl``). The database number is the URL path.
"""

from __future__ import annotations

import ssl as ssl_module
from typing import Any

import redis

from kombu_envelope.settings import Settings
from kombu_envelope.store.outages import OutageRetry

#: URL schemes that connect over TLS.
TLS_SCHEMES = frozenset({"envelopes"})

_SSL_NAMES = {
    "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
    "ssl_ca_path", "ssl_ca_data", "ssl_password",
}
_CERT_REQS = {
    ssl_module.CERT_NONE: "none", ssl_module.CERT_OPTIONAL: "optional",
    ssl_module.CERT_REQUIRED: "required",
}


def database_number(virtual_host: str | None) -> int:
    """The Redis database number named by kombu's virtual host ('', '/', '3', '/3')."""
    text = (virtual_host or "").strip("/")
    if not text:
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"database number must be an integer, not {virtual_host!r}") from exc


def connection_kwargs(conninfo: Any, settings: Settings) -> dict[str, Any]:
    """Keyword arguments for :class:`redis.ConnectionPool` from a kombu Connection."""
    kwargs: dict[str, Any] = {
        "host": conninfo.hostname or "localhost",
        "port": conninfo.port or 6379,
        "db": database_number(conninfo.virtual_host),
        "username": conninfo.userid or None,
        "password": conninfo.password or None,
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.socket_connect_timeout,
        "socket_keepalive": settings.socket_keepalive,
        "socket_keepalive_options": settings.socket_keepalive_options,
        "retry_on_timeout": settings.retry_on_timeout,
        "health_check_interval": settings.health_check_interval,
        "client_name": settings.client_name,
        "max_connections": settings.max_connections,
        "protocol": 2,  # replies are parsed as RESP2 arrays whatever the redis-py default
        "retry": OutageRetry(settings.outage_tolerance_s),
    }
    use_tls = conninfo.ssl or getattr(conninfo, "transport_cls", None) in TLS_SCHEMES
    if use_tls:
        kwargs["connection_class"] = redis.SSLConnection
        if isinstance(conninfo.ssl, dict):
            for name, value in conninfo.ssl.items():
                if name in _SSL_NAMES:
                    kwargs[name] = _CERT_REQS.get(value, value)
    kwargs.update(settings.connection_kwargs)
    return kwargs


def connection_pool(conninfo: Any, settings: Settings) -> redis.ConnectionPool:
    """A redis-py connection pool for a kombu Connection."""
    return redis.ConnectionPool(**connection_kwargs(conninfo, settings))
