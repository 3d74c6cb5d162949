"""Error answers: one JSON shape, ``{"error", "message", "violations"?}``, for every status.

A 422 lists the broken rules exactly as :attr:`InvalidEnvelope.violations` names them
(``field``, ``rule``, ``message``). No answer ever repeats a request header, so a
token sent by mistake is never echoed.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kombu_envelope.envelope import rule_name
from kombu_envelope.errors import InvalidEnvelope, InvalidQueueName, Violation


class Problem(Exception):
    """An answer other than success: its status, error code, message and extra fields."""

    def __init__(self, status: int, error: str, message: str, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.headers = headers
        self.extra = extra


def violation_json(violation: Violation) -> dict[str, str]:
    """A violation as the API writes it."""
    return {"field": violation.field, "rule": violation.rule, "message": violation.message}


def invalid(violations: list[Violation]) -> Problem:
    """The 422 of a request that breaks ``violations``."""
    return Problem(422, "invalid", "; ".join(str(v) for v in violations),
                   violations=[violation_json(v) for v in violations])


def _answer(problem: Problem) -> JSONResponse:
    return JSONResponse({"error": problem.error, "message": problem.message, **problem.extra},
                        status_code=problem.status, headers=problem.headers)


def _request_violations(exc: RequestValidationError) -> list[Violation]:
    found = []
    for error in exc.errors():
        loc = list(error.get("loc", ()))
        if error.get("type") == "json_invalid":  # its loc holds the offset, not a field
            loc = loc[:1]
        where = [str(part) for part in (loc[1:] if loc[:1] in _LOCATIONS else loc)]
        found.append(Violation(".".join(where) or "body", rule_name(error.get("type", "")),
                               str(error.get("msg", ""))))
    return found


_LOCATIONS = (["body"], ["query"], ["path"], ["header"])
_STATUS_ERRORS = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` in the one shape."""

    @app.exception_handler(Problem)
    async def _problem(_: Request, exc: Problem) -> JSONResponse:
        return _answer(exc)

    @app.exception_handler(InvalidEnvelope)
    async def _invalid_envelope(_: Request, exc: InvalidEnvelope) -> JSONResponse:
        return _answer(invalid(exc.violations))

    @app.exception_handler(InvalidQueueName)
    async def _invalid_queue(_: Request, exc: InvalidQueueName) -> JSONResponse:
        return _answer(invalid([Violation("queue", "pattern", str(exc))]))

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(invalid(_request_violations(exc)))

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_away(_: Request, exc: Exception) -> JSONResponse:
        return _answer(Problem(503, "redis_unavailable", "Redis cannot be reached"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not read the body (not UTF-8 JSON)
            return _answer(invalid([Violation("body", "json", str(exc.detail))]))
        error = _STATUS_ERRORS.get(exc.status_code, "error")
        return _answer(Problem(exc.status_code, error, str(exc.detail)))
