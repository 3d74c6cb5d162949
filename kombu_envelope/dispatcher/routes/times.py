"""Time query parameters: RFC 3339 with an offset, as in every Envelope."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import Query
from pydantic_core import PydanticCustomError

from kombu_envelope.dispatcher.problems import invalid
from kombu_envelope.envelope import parse_rfc3339
from kombu_envelope.errors import Violation

TimeQuery = Annotated[str | None, Query(description="RFC 3339 time with an offset",
                                        max_length=64)]


def parse_time(name: str, value: str | None) -> datetime | None:
    """``value`` as an aware datetime; a 422 naming ``name`` and the rule otherwise."""
    if value is None:
        return None
    try:
        return parse_rfc3339(value)
    except PydanticCustomError as exc:
        raise invalid([Violation(name, exc.type, exc.message())]) from exc
