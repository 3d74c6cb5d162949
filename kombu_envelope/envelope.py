"""The Envelope: the one task format every language reads and writes.

An Envelope is a JSON object. This module holds its pydantic model and its
validation rules; ``docs/protocol.md`` describes every field for implementers
in other languages and ``kombu_envelope/schemas/envelope.schema.json`` is the
JSON Schema generated from this model.

Rules that depend on the moment of publishing (how far ahead a task may be
scheduled) live in :func:`check_publishable`, so a stored Envelope stays
readable whatever the clock says.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError, to_json

from kombu_envelope.errors import InvalidEnvelope, Violation
from kombu_envelope.random_ids import new_ids
from kombu_envelope.trace_context import current_trace_id, trace_id_of

#: Lowest and highest ``priority``; a higher number is more urgent, in every language.
PRIORITY_MIN = 0
PRIORITY_MAX = 255
#: ``priority`` of an Envelope that does not say.
PRIORITY_DEFAULT = 100

#: Default ``max_retries`` (the same as Celery's).
MAX_RETRIES_DEFAULT = 3

#: Largest integer every JSON implementation reads exactly (JavaScript's MAX_SAFE_INTEGER).
MAX_SAFE_INTEGER = 2**53 - 1

#: RFC 3339 date-time with a mandatory offset; portable (ECMA 262, RE2, Python) syntax.
RFC3339_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
# Used with fullmatch(): "$" would also match before a trailing newline.
_RFC3339 = re.compile(
    r"(?P<date>[0-9]{4}-[0-9]{2}-[0-9]{2})[Tt](?P<time>[0-9]{2}:[0-9]{2}:[0-9]{2})"
    r"(?:\.(?P<frac>[0-9]{1,9}))?(?P<offset>[Zz]|[+-][0-9]{2}:[0-9]{2})"
)
# An RFC 3339 local date-time: a date-time that lacks only its offset.
_RFC3339_LOCAL = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?"
)
TASK_TYPE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$"
TOKEN_PATTERN = r"^[\x21-\x7e]+$"
EXT_NAMESPACE_PATTERN = r"^[a-z][a-z0-9_.\-]*$"


@dataclass(frozen=True)
class Limits:
    """Configurable validation limits.

    ``max_delay_s``: how far ahead of now (seconds) ``schedule_time`` may be at publish.
    ``max_payload_depth``: deepest nesting of objects/arrays; the payload object is level 1.
    ``max_payload_bytes``: largest payload, measured as compact UTF-8 JSON.
    """

    max_delay_s: float = 90 * 24 * 3600
    max_payload_depth: int = 5
    max_payload_bytes: int = 1024 * 1024


DEFAULT_LIMITS = Limits()


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(timezone.utc)


def _in_range(value: datetime) -> datetime:
    """Check an aware datetime can be written as RFC 3339 and compared with any other."""
    try:
        utc = value.astimezone(timezone.utc)
    except OverflowError as exc:
        raise PydanticCustomError(
            "rfc3339", "outside the years 0001-9999 once converted to UTC"
        ) from exc
    offset = value.utcoffset()
    if offset is not None and offset % timedelta(minutes=1):
        # RFC 3339 offsets are whole minutes; keep the instant, write it in UTC.
        return utc
    return value


def parse_rfc3339(value: Any) -> datetime:
    """Parse an RFC 3339 timestamp that carries an explicit offset (``Z`` or ``±hh:mm``).

    Aware :class:`datetime` objects are accepted as they are (converted to UTC
    if their offset is not whole minutes, which RFC 3339 cannot write). Naive datetimes,
    numbers (epoch seconds or milliseconds) and strings without an offset are
    refused: they are read differently by different languages. Fractions
    finer than a microsecond are truncated.
    """
    if isinstance(value, datetime):
        if value.tzinfo is timezone.utc:  # e.g. utcnow(): always in range, whole minutes
            return value
        if value.tzinfo is None or value.utcoffset() is None:
            raise PydanticCustomError(
                "timezone_required", "naive datetime: a timezone offset is required"
            )
        return _in_range(value)
    if isinstance(value, (bool, int, float)):
        raise PydanticCustomError(
            "type",
            "numeric timestamps are not accepted; use an RFC 3339 string with an offset",
        )
    if not isinstance(value, str):
        raise PydanticCustomError("type", "must be an RFC 3339 string with an offset")
    match = _RFC3339.fullmatch(value)
    if match is None:
        if _RFC3339_LOCAL.fullmatch(value):
            raise PydanticCustomError(
                "timezone_required",
                "no timezone offset: add Z or ±hh:mm, e.g. 2025-09-11T12:45:00+08:00",
            )
        raise PydanticCustomError(
            "rfc3339",
            "must be RFC 3339 with an explicit offset, e.g. 2025-09-11T12:45:00+08:00",
        )
    frac = (match["frac"] or "").ljust(6, "0")[:6]
    offset = match["offset"]
    if offset in ("Z", "z"):
        offset = "+00:00"
    elif int(offset[1:3]) > 23 or int(offset[4:6]) > 59:
        raise PydanticCustomError("rfc3339", "offset {offset} is not ±00:00 to ±23:59",
                                  {"offset": offset})
    try:
        parsed = datetime.fromisoformat(f"{match['date']}T{match['time']}.{frac}{offset}")
    except ValueError as exc:
        raise PydanticCustomError("rfc3339", "not a valid date, time or offset") from exc
    # An offset of 00:00 parses to timezone.utc: in range and whole minutes, as above.
    return parsed if parsed.tzinfo is timezone.utc else _in_range(parsed)


_ONE_MINUTE = timedelta(minutes=1)


def format_rfc3339(value: datetime) -> str:
    """Format an aware datetime as RFC 3339, keeping its offset (UTC is written ``Z``)."""
    if value.tzinfo is timezone.utc:  # the usual case, written on every Envelope
        return value.isoformat()[:-6] + "Z"
    offset = value.utcoffset()
    if offset is not None and offset % _ONE_MINUTE:
        value = value.astimezone(timezone.utc)
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


Timestamp = Annotated[
    datetime,
    BeforeValidator(parse_rfc3339),
    PlainSerializer(format_rfc3339, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time", "pattern": RFC3339_PATTERN}),
]


_JSON_SCALARS = (str, int, float, type(None))
# Exact types checked first: most values of a payload are one of them.
_EXACT_SCALARS = frozenset({str, int, bool, type(None)})


def _is_json_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _JSON_SCALARS)


def _quick_json_depth(value: Any, max_depth: int, level: int) -> int | None:
    """Depth of a valid JSON value, or None if anything is wrong (no error paths built)."""
    kind = type(value)
    if kind is dict or (kind is not list and isinstance(value, dict)):
        if level > max_depth:
            return None
        items: Any = value.values()
        for key in value:
            if type(key) is not str and not isinstance(key, str):
                return None
    elif kind is list or isinstance(value, list):
        if level > max_depth:
            return None
        items = value
    else:
        return level - 1 if _is_json_scalar(value) else None
    depth = level
    for item in items:
        kind = type(item)
        if kind in _EXACT_SCALARS:
            continue
        if kind is dict or kind is list or isinstance(item, (dict, list)):
            inner = _quick_json_depth(item, max_depth, level + 1)
            if inner is None:
                return None
            if inner > depth:
                depth = inner
        elif not _is_json_scalar(item):
            return None
    return depth


def _json_depth(value: Any, where: str, max_depth: int, level: int = 1) -> int:
    """Check that ``value`` holds only JSON values; return its nesting depth."""
    depth = _quick_json_depth(value, max_depth, level)
    if depth is not None:
        return depth
    return _explained_json_depth(value, where, max_depth, level)  # raises, naming the place


def _too_deep(where: str, max_depth: int) -> PydanticCustomError:
    return PydanticCustomError("max_depth", "nested deeper than {max_depth} levels at {where}",
                               {"max_depth": max_depth, "where": where})


def _explained_json_depth(value: Any, where: str, max_depth: int, level: int = 1) -> int:
    """:func:`_json_depth` that builds the path of each value, to name it in its error."""
    if isinstance(value, dict):
        if level > max_depth:
            raise _too_deep(where, max_depth)
        depth = level
        for key, item in value.items():
            if not isinstance(key, str):
                raise PydanticCustomError("json_value", "object keys must be strings")
            depth = max(depth, _explained_json_depth(item, f"{where}.{key}", max_depth,
                                                    level + 1))
        return depth
    if isinstance(value, list):
        if level > max_depth:
            raise _too_deep(where, max_depth)
        depth = level
        for index, item in enumerate(value):
            depth = max(depth, _explained_json_depth(item, f"{where}[{index}]", max_depth,
                                                    level + 1))
        return depth
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("json_value", "NaN and infinity are not JSON ({where})",
                                  {"where": where})
    if value is None or isinstance(value, (str, int, float)):
        return level - 1
    raise PydanticCustomError(
        "json_value",
        "{type} at {where} is not a JSON value",
        {"type": type(value).__name__, "where": where},
    )


def _to_json(value: Any, where: str) -> bytes:
    """Compact UTF-8 JSON of ``value``; a value JSON cannot hold breaks ``json_value``."""
    try:
        return to_json(value)
    except ValueError as exc:  # e.g. a lone surrogate, which UTF-8 cannot encode
        raise PydanticCustomError(
            "json_value", "{where} cannot be written as UTF-8 JSON: {error}",
            {"where": where, "error": str(exc)},
        ) from exc


#: The validation context of :meth:`Envelope.parse` without limits of its own (never changed).
_DEFAULT_CONTEXT = {"limits": DEFAULT_LIMITS}


def _limits(info: ValidationInfo) -> Limits:
    limits = info.context.get("limits") if info.context else None
    return limits if isinstance(limits, Limits) else DEFAULT_LIMITS


class Envelope(BaseModel):
    """A task, as every language sees it. Field meanings are in ``docs/protocol.md``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    task_id: Annotated[str, Field(min_length=1, max_length=255, pattern=TOKEN_PATTERN)]
    task_type: Annotated[str, Field(min_length=1, max_length=255, pattern=TASK_TYPE_PATTERN)]
    payload_version: Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INTEGER)] = 1
    payload: dict[str, Any] = Field(default_factory=dict)
    schedule_time: Timestamp | None = None
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INTEGER)] | None = None
    expires: Timestamp | None = None
    max_retries: Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INTEGER)] | None = MAX_RETRIES_DEFAULT
    retry_count: Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INTEGER)] = 0
    priority: Annotated[StrictInt, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)] = PRIORITY_DEFAULT
    trace_id: Annotated[str, Field(min_length=1, max_length=128, pattern=TOKEN_PATTERN)]
    created_at: Timestamp
    idempotency_key: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    ordering_key: (Annotated[str, Field(min_length=1, max_length=255, pattern=TOKEN_PATTERN)]
                   | None) = None
    headers: dict[str, str] = Field(default_factory=dict)
    ext: dict[
        Annotated[str, Field(pattern=EXT_NAMESPACE_PATTERN)], dict[str, Any]
    ] = Field(default_factory=dict)

    @field_validator("payload")
    @classmethod
    def _payload_is_small_shallow_json(
        cls, payload: dict[str, Any], info: ValidationInfo
    ) -> dict[str, Any]:
        limits = _limits(info)
        _json_depth(payload, "payload", limits.max_payload_depth)
        size = len(_to_json(payload, "payload"))
        if size > limits.max_payload_bytes:
            raise PydanticCustomError(
                "max_bytes",
                "payload is {size} bytes of JSON, above the limit of {limit}",
                {"size": size, "limit": limits.max_payload_bytes},
            )
        return payload

    @field_validator("ext")
    @classmethod
    def _ext_is_json(cls, ext: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not ext:
            return ext
        _json_depth(ext, "ext", max_depth=64)
        _to_json(ext, "ext")
        return ext

    @field_validator("headers")
    @classmethod
    def _headers_are_unicode(cls, headers: dict[str, str]) -> dict[str, str]:
        if not headers:
            return headers
        _to_json(headers, "headers")
        return headers

    @field_validator("retry_count")
    @classmethod
    def _retry_count_within_max(cls, retry_count: int, info: ValidationInfo) -> int:
        max_retries = info.data.get("max_retries")
        if max_retries is not None and retry_count > max_retries:
            raise PydanticCustomError(
                "retry_count_le_max_retries",
                "retry_count ({retry_count}) exceeds max_retries ({max_retries})",
                {"retry_count": retry_count, "max_retries": max_retries},
            )
        return retry_count

    @classmethod
    def parse(cls, data: Any, limits: Limits | None = None) -> Envelope:
        """Validate ``data`` (a dict or JSON text/bytes); raise :class:`InvalidEnvelope`.

        This is how an Envelope is read: ``task_id``, ``trace_id`` and
        ``created_at`` must be there. Use :meth:`new` to create one.
        """
        context = _DEFAULT_CONTEXT if limits is None else {"limits": limits}
        try:
            # The model's validator itself: model_validate* add a layer of Python per call.
            if isinstance(data, (str, bytes, bytearray)):
                return cls.__pydantic_validator__.validate_json(data, context=context)
            return cls.__pydantic_validator__.validate_python(data, context=context)
        except ValidationError as exc:
            raise InvalidEnvelope(violations_from(exc)) from exc

    @classmethod
    def new(cls, limits: Limits | None = None, **fields: Any) -> Envelope:
        """Create an Envelope from keyword fields; raise :class:`InvalidEnvelope`.

        A new ``task_id`` (UUID), ``trace_id`` and ``created_at`` (now) are
        filled in when not given: every task carries them on the wire, so that
        each reader of one entry sees the same identity. The default ``trace_id``
        is the trace's (its ``traceparent`` header, or the current trace), else new.
        """
        if "task_id" not in fields or "trace_id" not in fields:
            task_id, trace_id = new_ids()
            fields.setdefault("task_id", task_id)
            if "trace_id" not in fields:
                headers = fields.get("headers")
                fields["trace_id"] = (
                    (trace_id_of(headers.get("traceparent")) if isinstance(headers, dict)
                     else None) or current_trace_id() or trace_id)
        if "created_at" not in fields:
            fields["created_at"] = utcnow()
        return cls.parse(fields, limits)

    def to_json(self) -> bytes:
        """Canonical compact JSON.

        A ``null`` field is left out when ``null`` is also its default; otherwise
        (``"max_retries": null``, unlimited retries) it is written.
        """
        # The bytes of the model's serializer with the null-by-default fields excluded, from
        # a copy of the field values (in field order, as every Envelope holds them): cheaper
        # than pydantic's field filter.
        out = self.__dict__.copy()
        for name in _NULL_BY_DEFAULT:
            if out[name] is None:
                del out[name]
        for name in _TIMESTAMPS:
            value = out.get(name)
            if value is not None:
                out[name] = format_rfc3339(value)
        return to_json(out)

    def is_due(self, now: datetime | None = None) -> bool:
        """True when the task may run now (no ``schedule_time`` or one in the past)."""
        return self.schedule_time is None or self.schedule_time <= (now or utcnow())

    def is_expired(self, now: datetime | None = None) -> bool:
        """True when ``expires`` is at or before now: the task must not start."""
        return self.expires is not None and self.expires <= (now or utcnow())

    def due_ms(self) -> int:
        """Due time in milliseconds since the Unix epoch (now when unscheduled)."""
        when = self.schedule_time or utcnow()
        return (when - _EPOCH) // _ONE_MS


#: The fields left out of an Envelope's JSON when they are null (their default).
_NULL_BY_DEFAULT = tuple(
    name for name, info in Envelope.model_fields.items() if info.default is None
)
#: The :data:`Timestamp` fields, written by :func:`format_rfc3339`.
_TIMESTAMPS = tuple(
    name for name, info in Envelope.model_fields.items()
    if info.annotation is datetime or Timestamp in get_args(info.annotation)
)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)

# pydantic error types -> the language-neutral rule names of conformance/README.md.
# Errors raised by this module already use the neutral names.
_RULES = {
    "missing": "required",
    "extra_forbidden": "unknown_field",
    "string_pattern_mismatch": "pattern",
    "string_too_short": "length",
    "string_too_long": "length",
    "greater_than": "range",
    "greater_than_equal": "range",
    "less_than": "range",
    "less_than_equal": "range",
    "json_invalid": "json",
    "json_type": "json",
    "model_type": "type",
    "model_attributes_type": "type",
    "dict_type": "type",
    "string_type": "type",
    "string_unicode": "json_value",
    "int_type": "type",
    "int_parsing": "type",
    "int_from_float": "type",
    "bool_type": "type",
    "float_type": "type",
    "list_type": "type",
    "none_required": "type",
}


def rule_name(error_type: str) -> str:
    """The language-neutral rule name of a pydantic error type."""
    return _RULES.get(error_type, error_type)


def violations_from(exc: ValidationError) -> list[Violation]:
    """Turn pydantic's errors into :class:`Violation`s naming field and (neutral) rule."""
    found = []
    for error in exc.errors(include_url=False):
        path = [str(part) for part in error["loc"] if part != "[key]"]
        found.append(
            Violation(
                field=".".join(path) or "envelope",
                rule=rule_name(error["type"]),
                message=error["msg"],
            )
        )
    return found


def check_publishable(
    envelope: Envelope, limits: Limits | None = None, now: datetime | None = None
) -> None:
    """Apply the publish-time rules; raise :class:`InvalidEnvelope` if one is broken.

    ``schedule_time`` may be at most ``limits.max_delay_s`` ahead of ``now``:
    a timestamp read in the wrong unit would otherwise park a task for months.
    """
    limits = limits or DEFAULT_LIMITS
    if envelope.schedule_time is None:
        return
    horizon = (now or utcnow()) + timedelta(seconds=limits.max_delay_s)
    if envelope.schedule_time > horizon:
        raise InvalidEnvelope([
            Violation(
                field="schedule_time",
                rule="max_delay",
                message=(
                    f"{format_rfc3339(envelope.schedule_time)} is more than "
                    f"{timedelta(seconds=limits.max_delay_s)} (the maximum delay) ahead of now"
                ),
            )
        ])
