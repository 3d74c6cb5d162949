"""Celery message headers <-> Envelope fields: eta, expires, time limits and string headers.

Time limits: ``timeout_ms`` is the soft limit (Celery raises
``SoftTimeLimitExceeded`` inside the task, a ``timeout`` failure that follows
the retry policy), or the hard one when only that is set. On delivery it
becomes ``timelimit = [timeout_ms + HARD_LIMIT_GRACE_S, timeout_ms]`` (seconds),
unless the original header agrees and has a soft limit.

A header value kept under ``ext.celery.headers`` is written back on delivery
only while it still agrees with the Envelope field it maps to; when another
language changed the field, the field wins and the header is rebuilt from it.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from datetime import datetime
from typing import Any

#: W3C trace-context headers that, besides ``x-*`` headers, are Envelope headers.
W3C_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})

#: Header names of Celery's protocol 2 and of this mapping: never Envelope headers.
CELERY_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
    "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps", "compression",
    "trace_id", "payload_version", "idempotency_key", "ordering_key", "max_retries",
})


def is_envelope_header(name: Any, value: Any) -> bool:
    """True when a Celery header becomes an Envelope header.

    That is a header with a string value named ``x-*`` or ``traceparent``,
    ``tracestate`` or ``baggage`` (names compared case-insensitively).
    """
    if not isinstance(name, str) or name in CELERY_HEADERS or not isinstance(value, str):
        return False  # Celery's own names first: most headers of a task message
    lowered = name.lower()
    return lowered.startswith("x-") or lowered in W3C_HEADERS


def unsaid_headers(task_id: str) -> dict[str, Any]:
    """The headers Celery writes on every task message of ``task_id`` with nothing to say
    (no eta, group, parent, time limit or stamp; no positional argument; its own root).

    ``ext.celery.headers`` leaves out a header with exactly this value (type included),
    and delivery writes it back: a stored task is smaller, and delivered the same.
    A fresh dict on every call: its values are handed to Celery, which may change them.
    """
    return {"lang": "py", "shadow": None, "eta": None, "group": None, "group_index": None,
            "timelimit": [None, None], "root_id": task_id, "parent_id": None,
            "argsrepr": "()", "replaced_task_nesting": 0, "stamped_headers": None,
            "stamps": {}}


def split_headers(headers: Mapping[Any, Any], fields: Container[Any],
                  unsaid: Mapping[str, Any] | None = None
                  ) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``(kept, envelope)``: the headers of a task message that go to ``ext.celery.headers``
    (all but the Envelope headers, ``fields``, the headers that become Envelope fields,
    and those equal in value and type to their ``unsaid`` value, see
    :func:`unsaid_headers`) and its Envelope headers (see :func:`is_envelope_header`),
    in one pass."""
    kept: dict[Any, Any] = {}
    envelope: dict[Any, Any] = {}
    unsaid = unsaid or {}
    for name, value in headers.items():
        if is_envelope_header(name, value):
            envelope[name] = value
        elif name not in fields:
            default = unsaid.get(name, kept)  # ``kept``: a value no header can have
            if default is kept or type(value) is not type(default) or value != default:
                kept[name] = value
    return kept, envelope


def celery_headers_of(envelope_headers: dict[str, str]) -> dict[str, str]:
    """The Celery headers of an Envelope's headers: all but Celery's own names."""
    return {name: value for name, value in envelope_headers.items()
            if name not in CELERY_HEADERS}


def time_of(header: Any) -> Any:
    """The Envelope time field of a Celery time header (``eta`` or ``expires``).

    An ISO 8601 string with an offset becomes an aware datetime (Envelope
    validation normalises odd offsets such as ``+05:53:28``); anything else is
    returned as it is so Envelope validation names the problem, e.g. a time
    without offset.
    """
    if isinstance(header, str):
        try:
            parsed = datetime.fromisoformat(header)
        except ValueError:
            return header
        if parsed.utcoffset() is not None:
            return parsed
    return header


def time_header(original: Any, value: datetime | None) -> str | None:
    """The Celery header (``eta``, ``expires``) for a time field: the original text
    while it still agrees, else the field in ISO 8601."""
    if value is None:
        return None
    if time_of(original) == value:
        return str(original)
    return value.isoformat()


#: Seconds between the soft time limit (``timeout_ms``) and the hard one.
HARD_LIMIT_GRACE_S = 5


def _ms(seconds: Any) -> int | None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        return None
    return max(1, round(seconds * 1000))


def timeout_ms_of(timelimit: Any) -> int | None:
    """``timeout_ms`` of Celery's ``timelimit`` header ``[hard, soft]`` (seconds).

    The soft limit when set (it raises inside the task, so a timeout follows the
    retry policy), else the hard one; None when neither is.
    """
    if not isinstance(timelimit, (list, tuple)) or len(timelimit) != 2:
        return None
    hard, soft = timelimit
    return _ms(soft) or _ms(hard)


def timelimit_header(original: Any, timeout_ms: int | None) -> Any:
    """The ``timelimit`` header for ``timeout_ms``: ``[soft + grace, soft]``.

    The soft limit is ``timeout_ms``; the hard limit, which kills the process,
    comes :data:`HARD_LIMIT_GRACE_S` later. The original header is kept while it
    still agrees and has a soft limit.
    """
    if timeout_ms_of(original) == timeout_ms and (timeout_ms is None or _ms(original[1])):
        return original
    if timeout_ms is None:
        return [None, None]
    soft = timeout_ms // 1000 if timeout_ms % 1000 == 0 else timeout_ms / 1000
    return [soft + HARD_LIMIT_GRACE_S, soft]
