"""Waiting for replicas after a write: the ``wait_replicas`` option.

Redis replicates asynchronously: a primary answers a write before any replica has
it, and a failover promotes a replica that may lack the primary's last writes.
With ``wait_replicas`` set, each publish, each idempotency claim and each settling
step (ack, done marker, retry, dead letter, requeue) ends with
``WAIT <wait_replicas> <wait_timeout_ms>`` on the connection that wrote, in the same
pipeline, so the step returns only once that many replicas acknowledged it (or the
timeout passed). ``WAIT`` counts the writes of its own connection, which is why it
must share the pipeline (and so the connection, also when the pipeline is retried
after an outage).

A ``MULTI`` cannot end with ``WAIT`` (inside a transaction it does not block), so
with ``wait_replicas`` a transaction is sent as ``MULTI ... EXEC`` in a plain
pipeline followed by ``WAIT``: :func:`write_pipeline` and :func:`execute` hide
the difference. A ``WAIT`` answered by fewer replicas is logged and counted
(:func:`short_waits`); the write stands, as Redis keeps it either way.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kombu_envelope.settings import Settings
from kombu_envelope.store.scripts import script

__all__ = ["execute", "run_script", "short_waits", "write_pipeline"]

logger = logging.getLogger(__name__)

_MULTI = "_envelope_multi"
_short = 0
_short_lock = threading.Lock()


def _counter() -> Any:
    try:
        from prometheus_client import Counter
    except ImportError:  # the metrics extra is optional
        return None
    return Counter("envelope_wait_short", "WAITs answered by fewer replicas than "
                   "wait_replicas", ["step"])


_COUNTER = _counter()


def short_waits() -> int:
    """How many ``WAIT`` replies of this process named fewer replicas than asked."""
    return _short


def write_pipeline(client: Any, settings: Settings, *, transaction: bool) -> Any:
    """A pipeline for one write step; :func:`execute` runs it (with ``WAIT`` if set)."""
    if not settings.wait_replicas:
        return client.pipeline(transaction=transaction)
    pipe = client.pipeline(transaction=False)
    if transaction:
        pipe.execute_command("MULTI")
    setattr(pipe, _MULTI, transaction)
    return pipe


def execute(pipe: Any, settings: Settings, step: str) -> list[Any]:
    """Run a :func:`write_pipeline`; return the replies of the commands queued on it.

    ``step`` names the write in the log (``publish``, ``ack``...). With a
    transaction the replies are EXEC's, without redis-py's reply parsing (integers,
    byte strings and lists as Redis sent them).
    """
    if not settings.wait_replicas:
        replies: list[Any] = pipe.execute()
        return replies
    transaction = getattr(pipe, _MULTI, False)
    if transaction:
        pipe.execute_command("EXEC")
    pipe.execute_command("WAIT", settings.wait_replicas, settings.wait_timeout_ms)
    replies = pipe.execute()
    acknowledged_by(int(replies[-1]), settings, step)
    return list(replies[-2]) if transaction else replies[:-1]


def run_script(client: Any, settings: Settings, name: str, keys: list[Any], args: list[Any],
               step: str) -> Any:
    """Run script ``name`` once and return its reply, followed by ``WAIT`` when set.

    Without ``wait_replicas`` it is a plain ``EVALSHA``; with it, the script and its
    ``WAIT`` share a pipeline (and so pay redis-py's ``SCRIPT EXISTS`` round trip).
    """
    if not settings.wait_replicas:
        return script(client, name)(keys=keys, args=args)
    pipe = write_pipeline(client, settings, transaction=False)
    script(client, name)(keys=keys, args=args, client=pipe)
    return execute(pipe, settings, step)[0]


def acknowledged_by(replicas: int, settings: Settings, step: str) -> None:
    """Log and count a ``WAIT`` that ``replicas`` acknowledged, when fewer than asked."""
    global _short
    if replicas >= settings.wait_replicas:
        return
    with _short_lock:
        _short += 1
    if _COUNTER is not None:
        _COUNTER.labels(step).inc()
    logger.warning("%s acknowledged by %d of the %d replicas wait_replicas asks for within "
                   "%d ms: a failover now may lose it", step, replicas,
                   settings.wait_replicas, settings.wait_timeout_ms)
