"""Shared fixtures: a private Redis server per session and per-test key prefixes.

Set ``KOMBU_ENVELOPE_TEST_REDIS_URL`` to run against an existing server instead
of starting a private one.  Tests never flush the database: every test gets its
own key prefix.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from kombu_envelope.testing.redis_server import PrivateRedisServer

REDIS_URL_ENV = "KOMBU_ENVELOPE_TEST_REDIS_URL"


@dataclass(frozen=True)
class RedisEndpoint:
    """The Redis used by the session: an external URL or a private server."""

    url: str
    server: PrivateRedisServer | None = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisEndpoint]:
    """Session-wide Redis: ``$KOMBU_ENVELOPE_TEST_REDIS_URL`` or a private server."""
    external = os.environ.get(REDIS_URL_ENV)
    if external:
        yield RedisEndpoint(url=external)
        return
    with PrivateRedisServer() as server:
        yield RedisEndpoint(url=server.url, server=server)
        # Celery result objects left in reference cycles talk to Redis when collected:
        # collect them while it still runs, not at an arbitrary moment after.
        gc.collect()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisEndpoint) -> str:
    """URL of the session Redis."""
    return redis_server.url


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    """Short name of :func:`redis_client`, used by the interoperability tests."""
    return redis_client


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A ``redis.Redis`` client (bytes responses) on the session Redis."""
    client = redis.Redis.from_url(redis_url, decode_responses=False)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix unique to this test, e.g. ``t-3f9a1c2b7d``."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def private_redis() -> Iterator[PrivateRedisServer]:
    """A fresh private server with AOF for this test alone (restart/crash tests)."""
    with PrivateRedisServer(appendonly=True) as server:
        yield server
