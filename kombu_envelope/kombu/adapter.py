"""Message adapters: which kombu messages are tasks, and how they map to Envelopes.

The transport asks its adapter about every published message. A message the
adapter turns into an Envelope is a task and goes to the queue's task
streams, where any language reads it; anything else (events, remote-control
replies, plain kombu messages) stays in the queue's ``kombu`` stream.

The default adapter treats messages whose content type is
:data:`ENVELOPE_CONTENT_TYPE` as tasks: publish with ``serializer="envelope"``
and a body that is an :class:`~kombu_envelope.envelope.Envelope` or a dict of
its fields. ``celery_ext`` provides the adapter for Celery task messages; the
default one refuses them (headers ``task`` and ``id``, Celery's task protocol 2)
with :class:`~kombu_envelope.errors.CeleryExtensionMissing`, as it would store
them where no other language reads them.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from kombu.serialization import register
from pydantic_core import to_json

from kombu_envelope.envelope import Envelope, Limits
from kombu_envelope.errors import (
    CELERY_FIX,
    CeleryExtensionMissing,
    EnvelopeError,
    InvalidEnvelope,
)

#: Content type of a kombu message whose body is an Envelope.
ENVELOPE_CONTENT_TYPE = "application/vnd.kombu-envelope+json"


class Undeliverable(EnvelopeError):
    """An Envelope this consumer must not run; it goes to the dead-letter stream."""

    def __init__(self, failure_class: str, reason: str) -> None:
        self.failure_class = failure_class
        self.reason = reason
        super().__init__(f"{failure_class}: {reason}")


class NotRun(str, Enum):
    """Why a delivered task must not run (docs/protocol.md, section 5.1 step 3)."""

    #: Its task id is marked cancelled.
    REVOKED = "revoked"
    #: Its ``expires`` has passed.
    EXPIRED = "expired"


class MessageAdapter:
    """Converts between kombu messages and Envelopes (the default: envelope bodies)."""

    def to_envelope(self, message: dict[str, Any], body: bytes | str,
                    limits: Limits) -> Envelope | None:
        """The Envelope a published message carries, or None if it is not a task.

        ``message`` is kombu's message dict (``headers``, ``properties``,
        ``content-type``...), ``body`` its decoded body. Raise
        :class:`~kombu_envelope.errors.InvalidEnvelope` to refuse the publish.
        """
        headers = message.get("headers") or {}
        if "task" in headers and "id" in headers:
            raise CeleryExtensionMissing(
                f"Celery task {headers['task']!r} refused: without celery_ext, envelope:// "
                f"would store it as a plain kombu message that no other language reads; "
                f"{CELERY_FIX}")
        if message.get("content-type") != ENVELOPE_CONTENT_TYPE:
            return None
        try:
            return Envelope.parse(body, limits)  # an Envelope the serializer wrote
        except InvalidEnvelope as exc:
            if "required" not in exc.rules:
                raise
        # A dict without identity fields: a new task, whose identity is filled in.
        fields = json.loads(body)
        return Envelope.new(limits, **fields)

    def to_message(self, envelope: Envelope, queue: str) -> dict[str, Any]:
        """The kombu message dict delivered to consumers of ``queue``.

        Raise :class:`Undeliverable` to send the task to the dead-letter stream instead.
        """
        return {
            "body": envelope.to_json().decode("utf-8"),
            "content-type": ENVELOPE_CONTENT_TYPE,
            "content-encoding": "utf-8",
            "headers": {},
            "properties": {"priority": envelope.priority, "body_encoding": None,
                           "delivery_info": {}},
        }

    def refused(self, envelope: Envelope, failure_class: str, reason: str) -> None:
        """Called when a task is dead-lettered instead of delivered (:meth:`to_message`
        raised :class:`Undeliverable`, or its payload breaks its schema), before the
        dead-letter entry is written. The default does nothing."""

    def to_not_run_message(self, envelope: Envelope, queue: str,
                           why: NotRun) -> dict[str, Any] | None:
        """The message delivering a task that must not run to a consumer that records
        it as not run (a Celery worker marks it ``REVOKED``), or None: the transport
        acknowledges it without delivering it. The default: None."""
        return None


def _dumps(value: Any) -> str:
    if isinstance(value, Envelope):
        return value.to_json().decode("utf-8")
    # A dict is validated by the transport when it is published, with the
    # transport's limits; kombu would wrap an InvalidEnvelope raised here in a
    # plain EncodeError.
    return to_json(value).decode("utf-8")


def _loads(data: bytes | str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(data)
    return loaded


register("envelope", _dumps, _loads, content_type=ENVELOPE_CONTENT_TYPE,
         content_encoding="utf-8")
