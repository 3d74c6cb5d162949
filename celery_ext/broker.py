"""The Redis client and settings behind a Celery app's ``envelope://`` broker."""

from __future__ import annotations

from typing import Any

import redis

from kombu_envelope.settings import Settings
from kombu_envelope.store.client import connection_pool


def broker_settings(app: Any) -> Settings:
    """Transport settings from the app's ``broker_transport_options``."""
    return Settings.from_transport_options(app.conf.broker_transport_options)


def broker_redis(app: Any, settings: Settings | None = None) -> redis.Redis:
    """A Redis client on the app's broker (URL, credentials, TLS and timeouts)."""
    settings = settings or broker_settings(app)
    with app.connection_for_write() as conn:
        return redis.Redis(connection_pool=connection_pool(conn, settings))
