"""Shared fixtures: a private Redis server per session and per-test key prefixes.

The suite runs on two pytest-xdist workers (``-n 2``, README): each module stays on one
worker, so its module fixtures (a Celery worker, a Cluster) start once, and the modules
that build or run the other languages' shared build outputs (``sdk/java/target``,
``sdk/node/dist``, the peers) run one after another on one worker.

Set ``KOMBU_ENVELOPE_TEST_REDIS_URL`` to run against an existing server instead
of starting a private one.  Tests never flush the database: every test gets its
own key prefix.
"""

from __future__ import annotations

import ast
import gc
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from kombu_envelope.testing.redis_server import PrivateRedisServer

REDIS_URL_ENV = "KOMBU_ENVELOPE_TEST_REDIS_URL"

if sys.version_info < (3, 12):
    # CPython 3.11 keeps one AST recursion counter per interpreter (python/cpython#106905):
    # two threads in ast.parse at once (a background thread logging a traceback, whose
    # carets 3.11 finds with ast, while pytest or hypothesis parses source) make one of them
    # fail with "SystemError: AST constructor recursion depth mismatch", which ends the
    # session when it happens while pytest writes a report. One parse at a time.
    _ast_parse = ast.parse
    _ast_lock = threading.RLock()

    def _parse_one_at_a_time(*args: object, **kwargs: object) -> ast.AST:
        with _ast_lock:
            return _ast_parse(*args, **kwargs)  # type: ignore[arg-type]

    ast.parse = _parse_one_at_a_time  # type: ignore[assignment]


#: Modules that build or run the SDKs and the interop peers (see the module docstring).
PEER_MODULES = frozenset({
    "test_console", "test_fault_drill", "test_interop_celery", "test_interop_go",
    "test_interop_node", "test_matrix", "test_sdk_java", "test_sentinel",
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group tests for ``--dist loadgroup``: one group per module, one for the peers."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.path.stem
            item.add_marker(pytest.mark.xdist_group("peers" if module in PEER_MODULES
                                                    else module))


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
