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

On a Cluster the connection that wrote is one to the primary of the step's slot:
:func:`write_pipeline` takes the step's ``key`` and opens the pipeline on that node's
own client (a Cluster pipeline would send ``MULTI`` and ``WAIT`` to nodes of its
choosing), and :func:`execute` sends the whole step again to the slot's new owner
when the node answers ``MOVED``, ``ASK`` or a failover error, or is unreachable,
for up to ``outage_tolerance_s``. Script calls go through a
:class:`~kombu_envelope.store.batch.Batch`, which waits per node it wrote to
(its docstring says what it does not wait for on a Cluster).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis.client import Pipeline
from redis.cluster import RedisCluster

from kombu_envelope.settings import Settings
from kombu_envelope.store.cluster import CLUSTER_REDIRECTS, forget_slot_owner
from kombu_envelope.store.outages import is_outage
from kombu_envelope.store.packing import exec_transaction
from kombu_envelope.store.scripts import script

__all__ = ["execute", "run_script", "short_waits", "write_pipeline"]

logger = logging.getLogger(__name__)

_MULTI = "_envelope_multi"
_CLUSTER = "_envelope_cluster"
_KEY = "_envelope_key"
#: Pause before a Cluster step is sent again to its slot's owner (seconds).
_REDIRECT_PAUSE_S = 0.1
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


def write_pipeline(client: Any, settings: Settings, *, transaction: bool,
                   key: Any = None) -> Any:
    """A pipeline for one write step; :func:`execute` runs it (with ``WAIT`` if set).

    ``key`` is a key of the step (all of its keys share a slot); a Cluster with
    ``wait_replicas`` needs it to open the pipeline on the node that serves the slot.
    """
    if not settings.wait_replicas:
        return client.pipeline(transaction=transaction)
    if isinstance(client, RedisCluster):
        if key is None:
            raise ValueError("write_pipeline on a Cluster with wait_replicas needs the "
                             "step's key")
        pipe = _node_pipeline(client, key)
        setattr(pipe, _CLUSTER, client)
        setattr(pipe, _KEY, key)
    else:
        pipe = client.pipeline(transaction=False)
    if transaction:
        pipe.execute_command("MULTI")
    setattr(pipe, _MULTI, transaction)
    return pipe


def _node_pipeline(cluster: Any, key: Any) -> Any:
    """A plain pipeline on the client of the primary that serves ``key`` now."""
    node = cluster.get_node_from_key(key)
    if node.redis_connection is None:
        cluster.nodes_manager.initialize()
        node = cluster.get_node_from_key(key)
    return cluster.get_redis_connection(node).pipeline(transaction=False)


def execute(pipe: Any, settings: Settings, step: str) -> list[Any]:
    """Run a :func:`write_pipeline`; return the replies of the commands queued on it.

    ``step`` names the write in the log (``publish``, ``ack``...). With a
    transaction the replies are EXEC's, without redis-py's reply parsing (integers,
    byte strings and lists as Redis sent them).
    """
    if not settings.wait_replicas:
        if type(pipe) is Pipeline and pipe.transaction and not pipe.watching:
            return exec_transaction(pipe)  # one Redis: packed at once
        replies: list[Any] = pipe.execute()
        return replies
    cluster = getattr(pipe, _CLUSTER, None)
    if cluster is None:
        return _execute_waiting(pipe, settings, step)
    # On a Cluster: the same step again on the slot's owner while the slot moves or
    # its node fails over (every step sent this way is safe to repeat).
    transaction = getattr(pipe, _MULTI, False)
    key = getattr(pipe, _KEY)
    commands = [(args, options) for args, options in pipe.command_stack]
    deadline = time.monotonic() + settings.outage_tolerance_s
    while True:
        try:
            return _execute_waiting(pipe, settings, step)
        except Exception as exc:
            if not (isinstance(exc, CLUSTER_REDIRECTS) or is_outage(exc)) \
                    or time.monotonic() >= deadline:
                raise
            logger.info("%s: node of %s stopped serving it (%s); sending it again to the "
                        "slot's owner", step, key, exc)
            time.sleep(_REDIRECT_PAUSE_S)
            forget_slot_owner(cluster)
            pipe = _node_pipeline(cluster, key)
            setattr(pipe, _MULTI, transaction)
            for args, options in commands:
                pipe.pipeline_execute_command(*args, **options)


def _execute_waiting(pipe: Any, settings: Settings, step: str) -> list[Any]:
    transaction = getattr(pipe, _MULTI, False)
    if transaction:
        pipe.execute_command("EXEC")
    pipe.execute_command("WAIT", settings.wait_replicas, settings.wait_timeout_ms)
    replies = pipe.execute()
    acknowledged_by(int(replies[-1]), settings, step)
    return list(replies[-2]) if transaction else replies[:-1]


def run_script(client: Any, settings: Settings | None, name: str, keys: list[Any],
               args: list[Any], step: str) -> Any:
    """Run script ``name`` once and return its reply, followed by ``WAIT`` when set
    (``settings`` None: never).

    On one Redis, and with ``wait_replicas``, it is a one-step
    :class:`~kombu_envelope.store.batch.Batch`: the ``EVALSHA`` packed at once, on one
    connection with its ``WAIT`` (to the node of the script's keys on a Cluster). A Cluster
    without ``wait_replicas`` takes redis-py's script call, which follows the slot map.
    """
    if not (settings and settings.wait_replicas) and isinstance(client, RedisCluster):
        return script(client, name)(keys=keys, args=args)
    from kombu_envelope.store.batch import Batch

    return Batch(client, settings, step).script(name, keys, args).execute()[0]


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
