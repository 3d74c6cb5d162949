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

from typing import Any
from weakref import WeakKeyDictionary

from celery.backends.redis import RedisBackend

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
        target = (text, int(backend.expires) if backend.expires else None)
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
