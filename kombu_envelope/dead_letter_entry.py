"""The dead-letter entry as a model: every field a dead-letter stream entry may hold.

Entries are flat maps of field to string (Redis stream fields). Besides the
failure fields below, an entry holds every field of the original stream entry
under ``raw.<field>``, byte for byte; those are not JSON-safe in general, so the
model checks only their names. ``kombu_envelope/schemas/dead_letter.schema.json``
is generated from this model (see docs/protocol.md section 7).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kombu_envelope.envelope import RFC3339_PATTERN
from kombu_envelope.failures import DLQ_FORMAT_VERSION, FailureClass

#: Prefix of the fields that hold the original entry.
RAW_PREFIX = "raw."

_Time = Annotated[str, Field(pattern=RFC3339_PATTERN)]
_Count = Annotated[str, Field(pattern=r"^[0-9]+$")]


class DeadLetterEntry(BaseModel):
    """The fields of one dead-letter stream entry (format ``dlq`` = "1")."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "patternProperties": {r"^raw\..+$": {"type": "string"}},
            "additionalProperties": False,
        },
    )

    dlq: Annotated[str, Field(pattern=f"^{DLQ_FORMAT_VERSION}$")]
    failure_class: FailureClass
    reason: str
    queue: Annotated[str, Field(min_length=1)]
    dead_at: _Time
    language: Annotated[str, Field(min_length=1)]
    host: str
    pid: _Count
    consumer: str
    first_failure_at: _Time
    last_failure_at: _Time
    exception_type: str | None = None
    traceback: str | None = None
    attempts: _Count | None = None
    redeliveries: _Count | None = None
    task_id: str | None = None
    task_type: str | None = None
    source_stream: str | None = None
    source_id: str | None = None

    @model_validator(mode="after")
    def _only_raw_fields_besides(self) -> DeadLetterEntry:
        unknown = [name for name in self.model_extra or {} if not name.startswith(RAW_PREFIX)]
        if unknown:
            raise ValueError(f"unknown dead-letter fields {sorted(unknown)}; the original "
                             f"entry's fields are named '{RAW_PREFIX}<field>'")
        return self


def parse_dead_letter_fields(fields: dict[Any, Any]) -> DeadLetterEntry:
    """Validate the fields of a dead-letter entry (names and values as str or bytes)."""
    text = {
        (k.decode() if isinstance(k, bytes) else k):
        (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
    return DeadLetterEntry.model_validate(text)
