"""A two-minute tour: ``python -m celery_ext.demo``.

Starts a private ``redis-server`` on a free port (unless ``ENVELOPE_DEMO_REDIS_URL``
names one), publishes a few Celery tasks (one with a ``countdown``), prints the
streams and one stored Envelope, runs a real ``celery worker`` that executes
them, then shuts everything down.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from celery import Celery

import celery_ext  # noqa: F401  (registers the envelope:// transport)
from kombu_envelope.codec import decode_entry
from kombu_envelope.keys import KeySpace
from kombu_envelope.store.client import AnyRedis, client_for_url
from kombu_envelope.testing.redis_server import PrivateRedisServer

KEY_PREFIX = "demo"
REDIS_URL_ENV = "ENVELOPE_DEMO_REDIS_URL"

app = Celery("demo")
app.conf.update(
    broker_url=os.environ.get("ENVELOPE_DEMO_BROKER", "envelope://127.0.0.1:6379/0"),
    result_backend=os.environ.get("ENVELOPE_DEMO_BACKEND", "redis://127.0.0.1:6379/0"),
    broker_transport_options={"key_prefix": KEY_PREFIX},
    worker_hijack_root_logger=False,
)


@app.task(name="demo.add")
def add(x: int, y: int) -> int:
    """Add two numbers."""
    return x + y


@app.task(name="order.close_timeout")
def close_order(order_id: int, store_id: str) -> str:
    """Close an unpaid order (the task every language can publish)."""
    return f"order {order_id} of store {store_id} closed"


@contextlib.contextmanager
def _redis_url() -> Iterator[str]:
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        yield url
        return
    with PrivateRedisServer() as server:
        print(f"started a private redis-server {server.version} on port {server.port}")
        yield server.url


def _show_streams(client: AnyRedis) -> None:
    keys = KeySpace(KEY_PREFIX).queue("celery")
    print("\nwhat Redis holds for queue 'celery':")
    for stream in (*keys.task_streams, keys.kombu_stream, keys.dead):
        print(f"  {stream:<28} stream, {client.xlen(stream)} entries")
    print(f"  {keys.delayed:<28} delayed set, {client.zcard(keys.delayed)} task(s)")
    entries = client.xrange(keys.task_streams[1], count=1)
    if entries:
        envelope = decode_entry(entries[0][1])
        print("\none stored Envelope (what a Go or Node.js worker reads):")
        print(json.dumps(json.loads(envelope.to_json()), indent=2))


def _wait_for_acknowledgements(client: AnyRedis, timeout: float = 10.0) -> None:
    """Wait until the worker has acknowledged (deleted) every entry it ran.

    A result is stored before its entry is acknowledged when the worker ran the task
    from a timer (an eta); the acknowledgement follows on the next turn of the
    worker's event loop.
    """
    streams = KeySpace(KEY_PREFIX).queue("celery").task_streams
    deadline = time.monotonic() + timeout
    while any(client.xlen(stream) for stream in streams) and time.monotonic() < deadline:
        time.sleep(0.05)


def _start_worker(broker: str, backend: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, ENVELOPE_DEMO_BROKER=broker, ENVELOPE_DEMO_BACKEND=backend)
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_ext.demo", "worker", "--pool", "solo",
         "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--hostname",
         "demo@%h"],
        env=env,
    )


def _say(line: str) -> None:
    """Print ``line`` in one write: the worker shares the terminal, and its log lines would
    otherwise land between a line and its newline."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    """Run the demo."""
    with _redis_url() as url:
        parts = urlsplit(url)
        broker = f"envelope://{parts.netloc}{parts.path}"
        app.conf.update(broker_url=broker, result_backend=url)
        client = client_for_url(url)

        print("\npublishing: add(2, 3), add(40, 2) and order.close_timeout(countdown=3)")
        results = [add.delay(2, 3), add.delay(40, 2)]
        delayed = close_order.apply_async(kwargs={"order_id": 202509110001,
                                                  "store_id": "S10086"}, countdown=3)
        _show_streams(client)

        print("\nstarting a celery worker...\n")
        worker = _start_worker(broker, url)
        try:
            started = time.monotonic()
            for result in results:
                _say(f"  -> {result.get(timeout=60)}")
            _say(f"  -> {delayed.get(timeout=60)} "
                 f"({time.monotonic() - started:.1f} s after the worker started)")
            _wait_for_acknowledgements(client)
            _show_streams(client)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        print("\nworker stopped; demo done.")


if __name__ == "__main__":
    main()
