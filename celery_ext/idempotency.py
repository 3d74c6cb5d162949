"""Idempotency keys of Celery tasks, derived when the task is published.

A task opts in either per call, with the ``idempotency_key`` header::

    close_order.apply_async((order_id,), headers={"idempotency_key": str(order_id)})

or once for all calls, naming the payload fields that identify the business
action::

    @app.task(idempotency_fields=("order_id",))
    def close_order(order_id): ...

:func:`derive_idempotency_key` (a ``before_task_publish`` receiver) then sets
the header from those fields, so the Envelope carries the key and workers of
every language see it. The key is the fields' values joined with ``:``,
strings as they are and other values as compact JSON: ``order_id=202509110001``
gives ``"202509110001"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery_ext.arguments import bind
from celery_ext.registry import published_task

logger = logging.getLogger(__name__)

#: Task option naming the payload fields the idempotency key is made of.
FIELDS_OPTION = "idempotency_fields"
#: Celery header (and Envelope field) holding the key.
KEY_HEADER = "idempotency_key"


def key_from_payload(payload: Mapping[str, Any], names: Sequence[str]) -> str:
    """The idempotency key made of ``payload``'s fields ``names``; KeyError if one is missing."""
    values = (payload[name] for name in names)
    return ":".join(v if isinstance(v, str) else json.dumps(v, separators=(",", ":"),
                                                             sort_keys=True) for v in values)


def task_key(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The key of a call of ``task`` from its ``idempotency_fields`` (None: no option)."""
    names = getattr(task, FIELDS_OPTION, None)
    if not names:
        return None
    if isinstance(names, str):
        names = (names,)
    payload = bind(getattr(task, "run", None), args, kwargs).payload
    return key_from_payload(payload, names)


def derive_idempotency_key(sender: Any = None, body: Any = None,
                           headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` receiver: set ``idempotency_key`` from ``idempotency_fields``.

    An explicit header wins. Celery logs an exception raised by a receiver and
    publishes anyway, so a missing field is logged here and the task goes out
    without a key.
    """
    if headers is None or headers.get(KEY_HEADER) or not isinstance(sender, str):
        return
    task = published_task(sender)
    if task is None or not isinstance(body, (list, tuple)) or len(body) < 2:
        return
    try:
        key = task_key(task, body[0] or (), body[1] or {})
    except KeyError as exc:
        logger.warning("task %s published without idempotency key: payload field %s missing",
                       sender, exc)
        return
    if key is not None:
        headers[KEY_HEADER] = key
