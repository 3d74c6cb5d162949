"""Terminal failures of Celery tasks: how errors are classified, and dead-lettering.

A task raises :class:`InvalidPayload` when its payload can never work; it is
dead-lettered at once as ``invalid_payload``. ``celery.exceptions.Reject``
without requeue is ``rejected``; a soft or hard time limit is ``timeout``;
errors the retry policy calls transient are ``transient``; anything else is a
``task_error`` (docs/protocol.md, section 8).

Where the dead-letter entry comes from:

* with ``acks_late`` the stream entry is still pending while the task runs:
  ``dead_letter.lua`` moves it, so the dead-letter entry keeps the original
  bytes, byte for byte;
* with early acknowledgement (prefork) the entry is usually gone: the entry is
  written from the Envelope rebuilt from the Celery request (the same mapping a
  retry would publish; its ``created_at`` is the time of the failure). Its
  reason says so. The solo pool acknowledges after the task even then, so the
  original bytes are kept.
"""

from __future__ import annotations

import json
import logging
import traceback
from dataclasses import dataclass, replace
from typing import Any

from celery.exceptions import Reject, SoftTimeLimitExceeded, TimeLimitExceeded

from celery_ext.priority import UNSET_PRIORITY_PROPERTY
from celery_ext.protocol import JSON_CONTENT_TYPE, CeleryAdapter
from kombu_envelope.envelope import Envelope
from kombu_envelope.failures import Failure
from kombu_envelope.kombu.delivery_info import (
    INFO_CONSUMER,
    INFO_DUE_MS,
    INFO_ENTRY_ID,
    INFO_ORDER,
    INFO_QUEUE,
    INFO_SLOT,
    INFO_STREAM,
)
from kombu_envelope.retrying import ErrorKind, RetryPolicy
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import dead_letter_envelope, dead_letter_pending

logger = logging.getLogger(__name__)

#: Appended to the reason of a dead-letter entry written from the Celery request.
REBUILT_NOTE = " (entry rebuilt from the Celery request: it was acknowledged early)"


class InvalidPayload(Exception):
    """The payload can never work: the task is dead-lettered at once, without retries."""


def classify(exc: BaseException, policy: RetryPolicy) -> ErrorKind:
    """The kind of error ``exc`` is, under ``policy``."""
    if isinstance(exc, InvalidPayload):
        return ErrorKind.INVALID_PAYLOAD
    if isinstance(exc, Reject):
        return ErrorKind.REJECTED
    if isinstance(exc, (SoftTimeLimitExceeded, TimeLimitExceeded)):
        return ErrorKind.TIMEOUT
    if policy.is_transient(exc):
        return ErrorKind.TRANSIENT
    return ErrorKind.TASK_ERROR


def describe(exc: BaseException) -> tuple[str, str]:
    """``(exception_type, traceback)`` of ``exc`` for a dead-letter entry."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    return name, "".join(traceback.format_exception(kind, exc, exc.__traceback__))


@dataclass(frozen=True)
class Delivery:
    """Where a running task's entry came from (set by the transport in delivery_info)."""

    queue: str
    consumer: str
    stream: str | None = None
    entry_id: str | None = None
    due_ms: int | None = None  # when its task was due (ms since the Unix epoch)
    slot: str | None = None  # running key of the concurrency slot it holds (section 19)
    ordering_key: str | None = None  # its task's ordering key (section 20)

    @classmethod
    def of(cls, request: Any, fallback_consumer: str) -> Delivery:
        """The delivery of a Celery request (``request.properties["delivery_info"]``)."""
        properties = getattr(request, "properties", None) or {}
        info = properties.get("delivery_info") or getattr(request, "delivery_info", None) or {}
        queue = info.get(INFO_QUEUE) or info.get("routing_key") or "celery"
        return cls(queue=queue, consumer=info.get(INFO_CONSUMER) or fallback_consumer,
                   stream=info.get(INFO_STREAM), entry_id=info.get(INFO_ENTRY_ID),
                   due_ms=info.get(INFO_DUE_MS), slot=info.get(INFO_SLOT),
                   ordering_key=info.get(INFO_ORDER))


def envelope_of_request(task: Any, request: Any, settings: Settings) -> Envelope:
    """The Envelope of a running task, rebuilt from its Celery request."""
    options = request.as_execution_options()
    custom_headers = options.pop("headers", None) or {}
    task_id = options.pop("task_id")
    options["callbacks"] = options.pop("link", None)
    options["errbacks"] = options.pop("link_error", None)
    message = task.app.amqp.as_task_v2(task_id, task.name, request.args or (),
                                       request.kwargs or {}, **options)
    priority = (getattr(request, "delivery_info", None) or {}).get("priority")
    properties = {**message.properties, "priority": priority}
    if priority is None:
        properties[UNSET_PRIORITY_PROPERTY] = True
    headers = {**message.headers, **custom_headers}
    envelope = CeleryAdapter().to_envelope(
        {"headers": headers, "properties": properties, "content-type": JSON_CONTENT_TYPE,
         "content-encoding": "utf-8"},
        json.dumps(list(message.body)), settings.limits)
    assert envelope is not None  # a Celery task message always is a task
    return envelope


@dataclass(frozen=True)
class DeadLettered:
    """Where :func:`dead_letter_task` put a task."""

    dead_id: str
    #: Its stream entry was pending and went with ``dead_letter.lua`` (which also moved its
    #: ordering key on or halted it); False: rebuilt, the entry acknowledged already.
    from_entry: bool


def dead_letter_task(client: Any, settings: Settings, *, task: Any, request: Any,
                     delivery: Delivery, failure: Failure) -> DeadLettered | None:
    """Dead-letter a running task.

    Returns None when the entry is no longer pending although the task acks
    late: it was taken over, and its new consumer decides what happens to it.
    """
    if delivery.stream and delivery.entry_id:
        dead = dead_letter_pending(client, settings, queue=delivery.queue,
                                   stream=delivery.stream, entry_id=delivery.entry_id,
                                   failure=failure, consumer=delivery.consumer)
        if dead is not None:
            return DeadLettered(dead, from_entry=True)
        if task.acks_late:
            logger.warning("task %s[%s]: entry %s is no longer pending (taken over?); "
                           "not dead-lettered here", task.name, request.id, delivery.entry_id)
            return None
    envelope = envelope_of_request(task, request, settings)
    return DeadLettered(dead_letter_envelope(
        client, settings, envelope=envelope, queue=delivery.queue, consumer=delivery.consumer,
        failure=replace(failure, reason=failure.reason + REBUILT_NOTE)), from_entry=False)
