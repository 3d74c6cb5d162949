"""Celery task messages (protocol 2) <-> Envelopes, without losing anything.

A message is a Celery task when its headers hold ``task`` and ``id``. Its
body must be JSON (``task_serializer = "json"``) and uncompressed; anything
else is refused with :class:`~kombu_envelope.errors.UnsupportedMessage`
before it reaches Redis, as are protocol 1 task messages. Other messages go
to the base adapter. The body is read with plain :func:`json.loads`, so
kombu's ``{"__type__": ...}`` encodings (datetime, UUID, Decimal) stay as
they are and come back unchanged.

Field mapping (Celery -> Envelope; delivery does the reverse):

* ``task``, ``id`` -> ``task_type``, ``task_id``.
* ``kwargs`` and the named positional ``args`` -> ``payload`` (see below).
* ``retries`` -> ``retry_count``; the task's ``max_retries`` -> ``max_retries``
  (raised to ``retries`` when below it), the value written also kept as
  ``ext.celery.max_retries``. On delivery, the ``max_retries`` of an Envelope
  written by another language, or changed since Celery wrote it (``dlq
  replay --max-retries``), becomes the header ``max_retries``: Celery retries
  without their own ``max_retries`` are capped by it (``null``: unlimited),
  and a retry publishes it again instead of the task's value. Otherwise the
  worker's task decides, as in Celery.
* ``timelimit`` ``[hard, soft]`` (seconds) -> ``timeout_ms``: the soft limit,
  else the hard one; delivered as ``[soft + grace, soft]`` (see
  :mod:`celery_ext.headers`).
* ``eta`` -> ``schedule_time`` and ``expires`` -> ``expires``; a time without
  offset is refused. On delivery both headers are rebuilt from the fields, so
  the worker's own eta and expiry apply (an expired task is marked ``REVOKED``).
* priority 0..9 (0 most urgent) or none -> ``priority`` 255..0 or 100, see
  :mod:`celery_ext.priority`.
* ``trace_id`` header -> ``trace_id`` (a new one when missing).
* optional ``payload_version``, ``idempotency_key`` and ``ordering_key`` headers -> the
  fields of the same names.
* string-valued headers named ``x-*``, ``traceparent``, ``tracestate`` or
  ``baggage`` -> ``headers``; on delivery every Envelope header becomes a
  Celery header unless it is named like one of Celery's own.
* everything else -> ``ext.celery``: ``headers`` (every other header, eta and
  timelimit included), ``properties`` (correlation_id, reply_to...),
  ``priority`` (Celery's own) and ``embed`` (callbacks, errbacks, chain, chord).
* where the task's result goes, for a task that wants one from a Redis result
  backend -> ``ext.celery.result`` (see :mod:`celery_ext.results`).

What delivery writes anyway is left out of ``ext.celery``: the headers of
:func:`~celery_ext.headers.unsaid_headers` with exactly that value, a
``correlation_id`` that is the task id, a null ``priority``, an ``embed`` with
nothing in it.

On delivery, a value kept in ``ext.celery`` is used while it still agrees
with the Envelope field it maps to (see :mod:`celery_ext.headers`).

Positional arguments are named with the signature of the registered task
(``celery.current_app``, finalized first: :mod:`celery_ext.registry`) so other
languages see named payload fields; the
names go to ``ext.celery.argnames``. Arguments that cannot be named stay in
``ext.celery.args`` and other languages do not see them: ``*args`` extras,
all arguments of a task this process does not know, and calls that do not
bind (too many arguments, or a name also passed as a keyword).

An Envelope without ``ext.celery`` (written by another language) is
delivered as a plain Celery task: no positional arguments, the payload as
keyword arguments, and headers built from its fields.

A task that must not run (cancelled, or expired) is delivered to a Celery
worker that has it, which records it as ``REVOKED`` with Celery's own revoke
(the task id joins the worker's revoked ids) or expiry; other processes let the
transport acknowledge it without delivering it.

On delivery in a Celery worker (see :func:`serve_worker_app`), a task whose
``task_type`` the worker's app does not know is dead-lettered as
``unknown_task_type``; a task accepts the payload versions in its
``payload_versions`` option (default ``(1,)``) and dead-letters others as
``unsupported_payload_version``. Other processes (and a worker whose app is
not finalized yet) deliver every task: they cannot tell which tasks exist.
Then the transport dead-letters a payload that breaks its schema as
``invalid_payload`` (:mod:`kombu_envelope.store.schemas`), in every process.
A task dead-lettered before delivery gets its ``FAILURE`` result (:meth:`CeleryAdapter.refused`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery, current_app
from celery.utils.saferepr import saferepr
from celery.worker import state as worker_state
from kombu.serialization import registry

from celery_ext.arguments import bind, unbind
from celery_ext.headers import (
    celery_headers_of,
    split_headers,
    time_header,
    time_of,
    timelimit_header,
    timeout_ms_of,
    unsaid_headers,
)
from celery_ext.priority import (
    UNSET_PRIORITY_PROPERTY,
    to_celery_priority,
    to_envelope_priority,
)
from celery_ext.registry import published_task
from celery_ext.results import RESULT_EXT_KEY, record_undeliverable, result_ext
from celery_ext.tracing import remember_delivery
from kombu_envelope.envelope import MAX_RETRIES_DEFAULT, Envelope, Limits
from kombu_envelope.errors import UnsupportedMessage
from kombu_envelope.failures import FailureClass
from kombu_envelope.kombu.adapter import MessageAdapter, NotRun, Undeliverable

#: ``ext`` namespace of the Celery fields that have no Envelope field.
EXT_NAMESPACE = "celery"
JSON_CONTENT_TYPE = "application/json"
#: Payload versions a task accepts when it has no ``payload_versions`` option.
DEFAULT_PAYLOAD_VERSIONS = (1,)

#: Celery header carrying an Envelope's ``max_retries`` that differs from the task's.
MAX_RETRIES_HEADER = "max_retries"

# Headers that become Envelope fields and are not kept in ext.celery.headers.
_FIELD_HEADERS = frozenset({"task", "id", "retries", "trace_id", "expires"})
# Properties the transport sets on every message: not part of the task.
_TRANSPORT_PROPERTIES = frozenset({"delivery_info", "delivery_tag", "body_encoding",
                                   "priority", UNSET_PRIORITY_PROPERTY})
_EMPTY_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


# The app of the Celery worker running in this process, if any.
_worker_app: Celery | None = None


def set_worker_app(app: Celery | None) -> None:
    """Check deliveries in this process against ``app``'s tasks (None: no checks)."""
    global _worker_app
    _worker_app = app


def serve_worker_app(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: deliveries are checked against the worker's tasks.

    ``sender`` is the worker (any ``WorkController``, embedded ones included).
    Celery logs an exception raised here and starts the worker anyway.
    """
    set_worker_app(getattr(sender, "app", None))


def _worker_tasks() -> Mapping[str, Any] | None:
    """Task registry of this process's worker app once finalized, else None."""
    app = _worker_app
    if app is None or not app.finalized:
        return None
    tasks: Mapping[str, Any] = app.tasks
    return tasks


class CeleryAdapter(MessageAdapter):
    """Maps Celery protocol 2 task messages to Envelopes and back."""

    def to_envelope(self, message: dict[str, Any], body: bytes | str,
                    limits: Limits) -> Envelope | None:
        """The Envelope of a Celery task message; other messages go to the base adapter."""
        headers = message.get("headers") or {}
        if "task" in headers and "id" in headers:
            return _task_envelope(message, headers, body, limits)
        envelope = super().to_envelope(message, body, limits)
        if envelope is None:
            _refuse_protocol_1(message, body)
        return envelope

    def to_message(self, envelope: Envelope, queue: str) -> dict[str, Any]:
        """The Celery task message of an Envelope; Undeliverable when no task takes it.

        An undeliverable task whose producer asked for a result gets its ``FAILURE``
        (docs/protocol.md, section 12) before it is dead-lettered.
        """
        try:
            _check_deliverable(envelope)
        except Undeliverable as exc:
            self.refused(envelope, exc.failure_class, exc.reason)
            raise
        celery = envelope.ext.get(EXT_NAMESPACE)
        known = celery or {}
        args, kwargs = unbind(envelope.payload, _names(known), _list(known, "args"))
        embed = _dict(known, "embed") if "embed" in known else dict(_EMPTY_EMBED)
        if "properties" in known:
            properties = _dict(known, "properties")
            properties.setdefault("correlation_id", envelope.task_id)
        else:
            properties = {"correlation_id": envelope.task_id, "reply_to": ""}
        remember_delivery(envelope.task_id, envelope.trace_id)
        return {
            "body": json.dumps([args, kwargs, embed]),
            "content-type": JSON_CONTENT_TYPE,
            "content-encoding": "utf-8",
            "headers": _delivered_headers(envelope, celery),
            "properties": {**properties, "priority": _celery_priority(envelope, known),
                           "body_encoding": None, "delivery_info": {}},
        }

    def refused(self, envelope: Envelope, failure_class: str, reason: str) -> None:
        """Store the ``FAILURE`` of a task the transport dead-letters before Celery sees it."""
        if _worker_app is not None:
            record_undeliverable(_worker_app, envelope, failure_class, reason)

    def to_not_run_message(self, envelope: Envelope, queue: str,
                           why: NotRun) -> dict[str, Any] | None:
        """The message of a task that must not run, for the Celery worker that has it.

        The worker records it ``REVOKED`` (its result too): a cancelled id is
        added to the worker's revoked ids, an expired task carries its ``expires``.
        """
        tasks = _worker_tasks()
        if tasks is None or envelope.task_type not in tasks:
            return None
        try:
            message = self.to_message(envelope, queue)
        except Undeliverable:  # a payload version it refuses: nothing to record
            return None
        if why is NotRun.REVOKED:
            worker_state.revoked.add(envelope.task_id)
        return message


# ------------------------------------------------------------------ publish


def _task_envelope(message: dict[str, Any], headers: dict[str, Any], body: bytes | str,
                   limits: Limits) -> Envelope:
    _require_json(message, headers)
    args, kwargs, embed = _parse_body(body)
    name = headers["task"]
    task = published_task(name)
    app = current_app._get_current_object()
    bound = bind(getattr(task, "run", None), args, kwargs)

    task_id = headers["id"]
    kept, envelope_headers = split_headers(headers, _FIELD_HEADERS, unsaid_headers(task_id))
    properties = message.get("properties") or {}
    celery_priority = (None if properties.get(UNSET_PRIORITY_PROPERTY)
                       else properties.get("priority"))
    # What delivery would write anyway is left out: Celery's headers with nothing to
    # say, a correlation_id that is the task id, no priority, no callbacks.
    ext: dict[str, Any] = {
        "headers": kept,
        "properties": {k: v for k, v in properties.items() if k not in _TRANSPORT_PROPERTIES
                       and (k != "correlation_id" or v != task_id)},
    }
    if celery_priority is not None:
        ext["priority"] = celery_priority
    if embed != _EMPTY_EMBED:
        ext["embed"] = embed
    if bound.argnames:
        ext["argnames"] = bound.argnames
    if bound.rest:
        ext["args"] = bound.rest
    if isinstance(task_id, str):
        result = result_ext(app, task_id, headers)
        if result is not None:
            ext[RESULT_EXT_KEY] = result

    retries = headers.get("retries", 0)
    max_retries = (headers[MAX_RETRIES_HEADER] if MAX_RETRIES_HEADER in headers
                   else getattr(task, "max_retries", MAX_RETRIES_DEFAULT))
    if _is_int(retries) and _is_int(max_retries) and retries > max_retries:
        max_retries = retries
    ext["max_retries"] = max_retries  # so that a change by another language shows

    fields: dict[str, Any] = {
        "task_id": task_id,
        "task_type": name,
        "payload": bound.payload,
        "payload_version": headers.get("payload_version", 1),
        "schedule_time": time_of(headers.get("eta")),
        "expires": time_of(headers.get("expires")),
        "timeout_ms": timeout_ms_of(headers.get("timelimit")),
        "max_retries": max_retries,
        "retry_count": retries,
        "priority": to_envelope_priority(celery_priority),
        "idempotency_key": headers.get("idempotency_key"),
        "ordering_key": headers.get("ordering_key"),
        "headers": envelope_headers,
        "ext": {EXT_NAMESPACE: ext},
    }
    if "trace_id" in headers:
        fields["trace_id"] = headers["trace_id"]
    return Envelope.new(limits, **fields)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_json(message: dict[str, Any], headers: dict[str, Any]) -> None:
    content_type = message.get("content-type")
    if content_type != JSON_CONTENT_TYPE:
        serializer = registry.type_to_name.get(content_type, content_type)
        raise UnsupportedMessage(
            f"task {headers.get('task')!r} is serialized with {serializer!r}; envelope:// "
            "stores tasks as JSON: set task_serializer = 'json'"
        )
    if headers.get("compression"):
        raise UnsupportedMessage(
            f"task {headers.get('task')!r} is compressed ({headers['compression']}); "
            "envelope:// compresses large tasks itself: unset task_compression"
        )


def _parse_body(body: bytes | str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise UnsupportedMessage(f"Celery task body is not JSON: {exc}") from exc
    if (isinstance(data, list) and len(data) == 3 and isinstance(data[0], list)
            and isinstance(data[1], dict) and isinstance(data[2], dict)):
        return data[0], data[1], data[2]
    raise UnsupportedMessage("Celery task body is not [args, kwargs, embed] (protocol 2)")


def _refuse_protocol_1(message: dict[str, Any], body: bytes | str) -> None:
    """Raise UnsupportedMessage for a protocol 1 task (task fields in the body)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if message.get("content-type") != JSON_CONTENT_TYPE or '"task"' not in text:
        return
    try:
        data = json.loads(text)
    except ValueError:
        return
    if isinstance(data, dict) and "task" in data and "id" in data and "args" in data:
        raise UnsupportedMessage(
            f"task {data['task']!r} uses Celery task protocol 1, which envelope:// does "
            "not support: set task_protocol = 2"
        )


# ----------------------------------------------------------------- delivery


def _check_deliverable(envelope: Envelope) -> None:
    tasks = _worker_tasks()
    if tasks is None:
        return
    task = tasks.get(envelope.task_type)
    if task is None:
        raise Undeliverable(
            FailureClass.UNKNOWN_TASK_TYPE.value,
            f"no task named {envelope.task_type!r} is registered in this worker",
        )
    versions = payload_versions(task)
    if envelope.payload_version not in versions:
        raise Undeliverable(
            FailureClass.UNSUPPORTED_PAYLOAD_VERSION.value,
            f"task {envelope.task_type!r} accepts payload versions "
            f"{sorted(versions)}, not {envelope.payload_version}",
        )


def payload_versions(task: Any) -> frozenset[int]:
    """The payload versions ``task`` accepts (its ``payload_versions`` option)."""
    versions = getattr(task, "payload_versions", DEFAULT_PAYLOAD_VERSIONS)
    if isinstance(versions, int):
        return frozenset({versions})
    return frozenset(versions) if isinstance(versions, Iterable) else frozenset()


def _foreign_headers(envelope: Envelope) -> dict[str, Any]:
    """Celery headers of an Envelope written by another language."""
    return {**unsaid_headers(envelope.task_id), "expires": None,
            "kwargsrepr": saferepr(envelope.payload), "origin": None, "ignore_result": False}


def _delivered_headers(envelope: Envelope, celery: dict[str, Any] | None) -> dict[str, Any]:
    if celery is None:
        headers = _foreign_headers(envelope)
    else:  # the headers left out when it was stored, then the stored ones
        headers = unsaid_headers(envelope.task_id)
        headers.update(_dict(celery, "headers"))
    headers.update(celery_headers_of(envelope.headers))
    headers.update(task=envelope.task_type, id=envelope.task_id,
                   retries=envelope.retry_count, trace_id=envelope.trace_id)
    if celery is None or celery.get("max_retries", envelope.max_retries) != envelope.max_retries:
        headers[MAX_RETRIES_HEADER] = envelope.max_retries  # the Envelope's cap, not the task's
    if envelope.schedule_time is not None or "eta" in headers:
        headers["eta"] = time_header(headers.get("eta"), envelope.schedule_time)
    headers["expires"] = envelope.expires.isoformat() if envelope.expires else None
    if "timelimit" in headers or envelope.timeout_ms is not None:
        headers["timelimit"] = timelimit_header(headers.get("timelimit"), envelope.timeout_ms)
    if envelope.payload_version != 1 or "payload_version" in headers:
        headers["payload_version"] = envelope.payload_version
    if envelope.idempotency_key is not None:
        headers["idempotency_key"] = envelope.idempotency_key
    if envelope.ordering_key is not None:
        headers["ordering_key"] = envelope.ordering_key
    return headers


def _celery_priority(envelope: Envelope, celery: dict[str, Any]) -> int | None:
    """Celery's own priority while it still maps to the Envelope's, else the mapped one."""
    if "priority" in celery and to_envelope_priority(celery["priority"]) == envelope.priority:
        original: int | None = celery["priority"]
        return original
    return to_celery_priority(envelope.priority)


def _dict(ext: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A copy of ``ext[key]`` when it is an object, else an empty dict."""
    value = ext.get(key)
    return dict(value) if isinstance(value, dict) else {}


def _list(ext: Mapping[str, Any], key: str) -> list[Any]:
    value = ext.get(key)
    return list(value) if isinstance(value, list) else []


def _names(ext: Mapping[str, Any]) -> list[str]:
    names = _list(ext, "argnames")
    return names if all(isinstance(name, str) for name in names) else []
