"""Helpers for tests of the ``envelope://`` kombu transport: URLs and stream contents."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import kombu

import kombu_envelope  # noqa: F401  (registers the envelope:// transport)
from kombu_envelope.keys import KeySpace

__all__ = [
    "connect",
    "dead_letters",
    "drain_until",
    "envelope_url",
    "pending_count",
    "stream_entries",
    "text_fields",
]


def envelope_url(redis_url: str, scheme: str = "envelope") -> str:
    """The ``envelope://host:port/db`` URL of the server behind ``redis_url``."""
    parts = urlsplit(redis_url)
    db = parts.path.strip("/") or "0"
    return f"{scheme}://{parts.hostname or '127.0.0.1'}:{parts.port or 6379}/{db}"


def drain_until(conn: kombu.Connection, done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Call ``drain_events`` until ``done()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"condition not met within {timeout:.1f}s of drain_events")
        try:
            conn.drain_events(timeout=min(remaining, 1.0))
        except TimeoutError:
            pass


def connect(redis_url: str, key_prefix: str, **options: Any) -> kombu.Connection:
    """A plain-kombu Connection on ``envelope://`` whose keys all start with ``key_prefix``.

    The base message adapter is named explicitly: once ``celery_ext`` is imported in
    the same process, ``envelope://`` delivers every Envelope as a Celery task message.
    """
    options = {"message_adapter": "kombu_envelope.kombu.adapter:MessageAdapter", **options}
    return kombu.Connection(
        envelope_url(redis_url), transport_options={"key_prefix": key_prefix, **options}
    )


def text_fields(fields: dict[Any, Any]) -> dict[str, bytes]:
    """Entry fields with ``str`` names and ``bytes`` values."""
    return {
        (k.decode() if isinstance(k, bytes) else k): (v if isinstance(v, bytes) else
                                                      str(v).encode())
        for k, v in fields.items()
    }


def stream_entries(client: Any, stream: str) -> list[tuple[str, dict[str, bytes]]]:
    """Every entry of ``stream`` as ``(id, fields)``, oldest first."""
    return [
        (entry_id.decode() if isinstance(entry_id, bytes) else entry_id, text_fields(fields))
        for entry_id, fields in client.xrange(stream)
    ]


def dead_letters(client: Any, key_prefix: str, queue: str) -> list[dict[str, bytes]]:
    """Fields of every entry of ``queue``'s dead-letter stream, oldest first."""
    return [fields for _, fields in
            stream_entries(client, KeySpace(key_prefix).queue(queue).dead)]


def pending_count(client: Any, stream: str, group: str) -> int:
    """Entries of ``stream`` read by ``group`` and not acknowledged yet."""
    if not client.exists(stream):
        return 0
    summary = client.xpending(stream, group)
    return int(summary["pending"])
