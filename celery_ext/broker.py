"""The Redis client and settings behind a Celery app's ``envelope://`` broker."""

from __future__ import annotations

from typing import Any

from kombu_envelope.kombu.transport import Transport as EnvelopeTransport
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import AnyRedis, RedisEndpoint, new_client


def broker_settings(app: Any) -> Settings:
    """Transport settings from the app's ``broker_transport_options``."""
    return Settings.from_transport_options(app.conf.broker_transport_options)


def broker_redis(app: Any, settings: Settings | None = None) -> AnyRedis:
    """A Redis client on the app's broker (URL, credentials, TLS and timeouts)."""
    settings = settings or broker_settings(app)
    with app.connection_for_write() as conn:
        return new_client(RedisEndpoint.from_conninfo(conn), settings)


def uses_envelope_broker(app: Any) -> bool:
    """True when the app's broker transport is kombu-envelope's (or a subclass)."""
    with app.connection_for_write() as conn:
        return isinstance(conn.transport, EnvelopeTransport)
