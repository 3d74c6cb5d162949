"""Payload schemas (docs/protocol.md, section 16): a JSON Schema per task type and version.

Schemas are JSON Schema draft 2020-12 documents, stored in the hash
``<prefix>:schemas``, field ``<task_type>@<payload_version>``. Producers refuse a
task whose payload breaks its schema (:meth:`PayloadSchemas.check`), workers
dead-letter it; both keep what they read for ``schema_cache_s``.

A violation names the offending value by its path below ``payload``: members as
``.name``, array items as ``[index]`` (``payload.lines[2].sku``, ``payload`` for
the payload itself). ``required`` names each missing member and
``"additionalProperties": false`` each unexpected one; every other keyword names
the value it judged. Violations come sorted by path (segment by segment, indices
as numbers), then keyword. ``format`` is an annotation: it is never asserted.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import extend
from referencing.exceptions import Unresolvable

from kombu_envelope.envelope import TASK_TYPE_PATTERN, Envelope
from kombu_envelope.errors import InvalidEnvelope, InvalidSchema, Violation
from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

logger = logging.getLogger(__name__)

#: Rule of every schema violation.
SCHEMA_RULE = "schema"

#: A schema's identity: ``(task_type, payload_version)``.
SchemaId = tuple[str, int]


@dataclass(frozen=True)
class SchemaViolation(Violation):
    """A payload that breaks its schema: :attr:`keyword` is the JSON Schema keyword."""

    keyword: str


class PayloadSchemas:
    """The payload schemas of one key prefix: register, read, delete, enforce.

    :meth:`get`, :meth:`all`, :meth:`register` and :meth:`delete` go to Redis
    every time; :meth:`violations` and :meth:`check` use the schemas read at most
    ``cache_s`` seconds ago (default: the ``schema_cache_s`` setting).
    """

    def __init__(self, client: Any, settings: Settings | None = None,
                 cache_s: float | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.cache_s = self.settings.schema_cache_s if cache_s is None else cache_s
        self._key = self.settings.keys.schemas
        # field -> (stored text, its validator or None when it cannot be used)
        self._compiled: dict[str, tuple[str, Validator | None]] = {}
        self._validators: dict[SchemaId, Validator] = {}
        self._read_at: float | None = None

    def register(self, task_type: str, payload_version: int, schema: dict[str, Any]) -> None:
        """Store (or replace) the schema of ``task_type`` at ``payload_version``.

        Raises :class:`~kombu_envelope.errors.InvalidSchema` when ``schema`` is not
        a valid draft 2020-12 schema object, or the task type or version is invalid.
        """
        field = field_name(task_type, payload_version)
        compile_schema(schema)
        self.client.hset(self._key, field, json.dumps(schema, ensure_ascii=False))
        self._read_at = None

    def get(self, task_type: str, payload_version: int) -> dict[str, Any] | None:
        """The schema of ``task_type`` at ``payload_version``, or None."""
        field = field_name(task_type, payload_version)
        text = self.client.hget(self._key, field)
        return None if text is None else _loaded(field, as_text(text))

    def all(self) -> dict[SchemaId, dict[str, Any]]:
        """Every stored schema that can be read, by ``(task_type, payload_version)``."""
        found = {}
        for field, text in self._stored().items():
            schema_id, schema = _schema_id(field), _loaded(field, text)
            if schema_id is not None and schema is not None:
                found[schema_id] = schema
        return dict(sorted(found.items()))

    def delete(self, task_type: str, payload_version: int) -> bool:
        """Delete the schema of ``task_type`` at ``payload_version``; False if there was none."""
        deleted = bool(self.client.hdel(self._key, field_name(task_type, payload_version)))
        self._read_at = None
        return deleted

    def violations(self, envelope: Envelope) -> list[Violation]:
        """How ``envelope``'s payload breaks its schema (empty: it does not, or has none)."""
        schema_id = (envelope.task_type, envelope.payload_version)
        validator = self._current().get(schema_id)
        if validator is None:
            return []
        try:
            return payload_violations(validator, envelope.payload)
        except Unresolvable as exc:
            self._ignore(field_name(*schema_id), f"a reference cannot be resolved: {exc}")
            return []

    def check(self, envelope: Envelope) -> None:
        """Raise :class:`~kombu_envelope.errors.InvalidEnvelope` if the payload breaks
        its schema."""
        found = self.violations(envelope)
        if found:
            raise InvalidEnvelope(found)

    # ------------------------------------------------------------------ cache

    def _stored(self) -> dict[str, str]:
        return {as_text(field): as_text(text)
                for field, text in self.client.hgetall(self._key).items()}

    def _current(self) -> dict[SchemaId, Validator]:
        """The validators of the stored schemas, read again once ``cache_s`` passed."""
        now = monotonic()
        if self._read_at is not None and now - self._read_at < self.cache_s:
            return self._validators
        stored = self._stored()
        compiled = {}
        for field, text in stored.items():
            known = self._compiled.get(field)
            if known is None or known[0] != text:  # compile only what changed
                known = (text, _usable(field, text))
            compiled[field] = known
        self._compiled = compiled
        self._validators = {schema_id: validator
                            for field, (_, validator) in compiled.items()
                            if (schema_id := _schema_id(field)) is not None
                            and validator is not None}
        self._read_at = now
        return self._validators

    def _ignore(self, field: str, why: str) -> None:
        """Stop using the schema stored at ``field`` until it is registered again."""
        logger.warning("payload schema %s is ignored: %s", field, why)
        text = self._compiled.get(field, ("", None))[0]
        self._compiled[field] = (text, None)
        schema_id = _schema_id(field)
        if schema_id is not None:
            self._validators.pop(schema_id, None)


def field_name(task_type: str, payload_version: int) -> str:
    """The hash field of a schema, ``<task_type>@<payload_version>``.

    Raises :class:`~kombu_envelope.errors.InvalidSchema` for a task type or
    version no Envelope can have.
    """
    if not isinstance(task_type, str) or not re.fullmatch(TASK_TYPE_PATTERN, task_type):
        raise InvalidSchema(f"task_type {task_type!r} does not match {TASK_TYPE_PATTERN}")
    if (not isinstance(payload_version, int) or isinstance(payload_version, bool)
            or payload_version < 1):
        raise InvalidSchema(f"payload_version must be an integer >= 1, not {payload_version!r}")
    return f"{task_type}@{payload_version}"


#: The only dialect payload schemas use (docs/protocol.md, section 16).
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


def compile_schema(schema: Any) -> Validator:
    """The validator of ``schema``; :class:`~kombu_envelope.errors.InvalidSchema` if
    it is not a valid draft 2020-12 schema object."""
    if not isinstance(schema, dict):
        raise InvalidSchema(f"a payload schema must be a JSON object, not {type(schema).__name__}")
    dialect = schema.get("$schema", DRAFT_2020_12)
    if dialect != DRAFT_2020_12:
        raise InvalidSchema(f"$schema must be {DRAFT_2020_12} (or left out), not {dialect!r}")
    try:
        PayloadValidator.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"/{part}" for part in exc.absolute_path)  # a JSON pointer
        raise InvalidSchema(f"not a valid draft 2020-12 schema: at #{where}: {exc.message}"
                            ) from exc
    validator: Validator = PayloadValidator(schema)
    try:
        list(validator.iter_errors({}))  # resolves the references the top level makes
    except Unresolvable as exc:
        raise InvalidSchema(f"a reference cannot be resolved: {exc}") from exc
    return validator


def payload_violations(validator: Validator, payload: Any) -> list[Violation]:
    """How ``payload`` breaks the schema of ``validator`` (from :func:`compile_schema`),
    sorted by path, then keyword."""
    return [_violation(error) for error in sorted(validator.iter_errors(payload), key=_order)]


#: Longest dead-letter reason (characters): validators repeat the offending value.
MAX_REASON = 1000


def dead_letter_reason(violations: Sequence[Violation]) -> str:
    """The reason of the dead-letter entry of a payload that breaks its schema."""
    reason = "schema: " + "; ".join(f"{v.field}: {v.message}" for v in violations)
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 1] + "…"


# ------------------------------------------------------------ the validator

_DRAFT = Draft202012Validator.VALIDATORS


def _required(validator: Any, required: Any, instance: Any,
              schema: Any) -> Iterator[ValidationError]:
    """``required``, with one error per missing member, on the member's path."""
    if not validator.is_type(instance, "object") or not isinstance(required, list):
        yield from _DRAFT["required"](validator, required, instance, schema)
        return
    for name in required:
        if name not in instance:
            yield from _on_member(name, _DRAFT["required"](validator, [name], instance, schema))


def _additional_properties(validator: Any, allowed: Any, instance: Any,
                           schema: Any) -> Iterator[ValidationError]:
    """``additionalProperties``; ``false`` gives one error per unexpected member, on its path."""
    if allowed is not False or not validator.is_type(instance, "object"):
        yield from _DRAFT["additionalProperties"](validator, allowed, instance, schema)
        return
    for name in _unexpected(instance, schema):
        yield from _on_member(name, _DRAFT["additionalProperties"](
            validator, allowed, {name: instance[name]}, schema))


def _on_member(name: str, errors: Iterator[ValidationError]) -> Iterator[ValidationError]:
    for error in errors:
        error.path.appendleft(name)
        yield error


def _unexpected(instance: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Members neither in ``properties`` nor matched by ``patternProperties``."""
    named = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [name for name in instance
            if name not in named and not any(re.search(p, name) for p in patterns)]


#: Draft 2020-12, with ``required`` and ``additionalProperties: false`` naming members.
PayloadValidator = extend(Draft202012Validator, {"required": _required,
                                                 "additionalProperties": _additional_properties})


# ----------------------------------------------------------------- helpers


def _json_path(path: Sequence[str | int]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)


def _violation(error: ValidationError) -> SchemaViolation:
    return SchemaViolation(field="payload" + _json_path(error.absolute_path), rule=SCHEMA_RULE,
                           message=error.message, keyword=str(error.validator))


def _order(error: ValidationError) -> tuple[Any, ...]:
    """Path segment by segment (a name or an index: never both at one place), then keyword."""
    path = tuple((isinstance(part, str), part) for part in error.absolute_path)
    return path, str(error.validator), error.message


def _schema_id(field: str) -> SchemaId | None:
    task_type, _, version = field.rpartition("@")
    if not task_type or not version.isdigit() or not version.isascii():
        logger.warning("payload schema field %r is not <task_type>@<payload_version>", field)
        return None
    return task_type, int(version)


def _loaded(field: str, text: str) -> dict[str, Any] | None:
    """The stored schema as JSON, or None (logged) when it is no JSON object."""
    try:
        schema = json.loads(text)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        logger.warning("payload schema %s is ignored: not a JSON object: %.80r", field, text)
        return None
    return schema


def _usable(field: str, text: str) -> Validator | None:
    """The validator of a stored schema, or None (logged) when it cannot be used."""
    schema = _loaded(field, text)
    if schema is None:
        return None
    try:
        return compile_schema(schema)
    except InvalidSchema as exc:
        logger.warning("payload schema %s is ignored: %s", field, exc)
        return None
