"""What every route module shares: the store objects, limits, error answers and paths."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import Path, Query, Request
from starlette.concurrency import run_in_threadpool

from kombu_envelope.dispatcher.config import DispatcherConfig
from kombu_envelope.dispatcher.models import ProblemOut
from kombu_envelope.dispatcher.stores import Stores
from kombu_envelope.envelope import TOKEN_PATTERN, format_rfc3339

#: Answers any endpoint may give besides its own.
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ProblemOut, "description": text} for status, text in (
        (401, "no token, or one that is not known"),
        (403, "the token's scope does not allow this endpoint"),
        (413, "the request body is too large"),
        (422, "the request breaks a rule: each violation names the field and the rule"),
        (429, "too many requests for this token"),
    )
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """:data:`COMMON_RESPONSES` plus ``statuses`` (404, 409...) with the error shape."""
    extra = {404: "not found", 409: "no live or recently seen worker serves it",
             503: "Redis cannot be reached"}
    return {**COMMON_RESPONSES,
            **{s: {"model": ProblemOut, "description": extra[s]} for s in statuses}}


def stores(request: Request) -> Stores:
    """The app's store objects."""
    found: Stores = request.app.state.stores
    return found


def config(request: Request) -> DispatcherConfig:
    """The app's configuration."""
    found: DispatcherConfig = request.app.state.config
    return found


async def blocking(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a function that talks to Redis off the event loop (it may wait out an outage)."""
    return await run_in_threadpool(func, *args, **kwargs)


def text_time(value: datetime | None) -> str | None:
    """An RFC 3339 string, or None."""
    return None if value is None else format_rfc3339(value)


TaskId = Annotated[str, Path(min_length=1, max_length=255, pattern=TOKEN_PATTERN)]
QueueName = Annotated[str, Path(min_length=1, max_length=255, pattern=r"^[^{}]+$")]
QueueQuery = Annotated[str | None, Query(min_length=1, max_length=255, pattern=r"^[^{}]+$")]
