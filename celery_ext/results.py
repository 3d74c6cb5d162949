"""Where the result of a task is written, for workers of any language (docs/protocol.md, 12).

A Celery producer writes ``ext.celery.result`` = ``{"key": ..., "expires_s": ...}``
when the task wants a result (its ``ignore_result`` header is false) and the
app's result backend is Celery's Redis backend (``redis://``, ``rediss://``,
``sentinel://``): ``key`` is the key that backend reads for the task id (its
``celery-task-meta-`` prefix and ``global_keyprefix`` included), ``expires_s``
its ``result_expires`` in seconds (None: no expiry). A worker of another
language that runs the task writes its outcome there. Nothing is written for
other backends, whose keys no other language can reach.

What is per app (the key prefix, the expiry) is worked out once per app.
"""

from __future__ import annotations

import logging
import math
from typing import Any
from weakref import WeakKeyDictionary

from celery.backends.redis import RedisBackend
from celery.utils.serialization import create_exception_cls

from kombu_envelope.envelope import Envelope

logger = logging.getLogger(__name__)

#: Key of ``ext.celery`` naming where the result goes.
RESULT_EXT_KEY = "result"

# app -> (key prefix, expires_s), or None when its backend is not a Redis one.
_targets: WeakKeyDictionary[Any, tuple[str, int | None] | None] = WeakKeyDictionary()


def _target(app: Any) -> tuple[str, int | None] | None:
    try:
        return _targets[app]
    except KeyError:
        pass
    backend = app.backend
    target = None
    if isinstance(backend, RedisBackend):
        prefix = backend.key_t(backend.task_keyprefix)
        text = prefix.decode() if isinstance(prefix, bytes) else str(prefix)
        target = (text, math.ceil(backend.expires) if backend.expires else None)
    _targets[app] = target
    return target


def result_ext(app: Any, task_id: str, headers: dict[str, Any]) -> dict[str, Any] | None:
    """``ext.celery.result`` of a task message of ``app``, or None when none is written."""
    if headers.get("ignore_result"):
        return None
    target = _target(app)
    if target is None:
        return None
    prefix, expires_s = target
    return {"key": prefix + task_id, "expires_s": expires_s}


def record_undeliverable(app: Any, envelope: Envelope, failure_class: str, reason: str) -> None:
    """Store ``FAILURE`` for a task this worker dead-letters before Celery sees it.

    Only when its producer asked for a result (``ext.celery.result``) and ``app``
    has a Redis result backend: the exception is named after the failure class,
    with the dead-letter reason as its message, as every language writes it.
    A backend error is logged; the task is dead-lettered anyway.
    """
    if not isinstance((envelope.ext.get("celery") or {}).get(RESULT_EXT_KEY), dict):
        return
    if not isinstance(app.backend, RedisBackend):
        return
    error = create_exception_cls(failure_class, __name__)(reason)
    try:
        app.backend.mark_as_failure(envelope.task_id, error)
    except Exception as exc:  # the result backend is not the broker: never block a dead letter
        logger.warning("task %s: storing its FAILURE result failed: %r", envelope.task_id, exc)

