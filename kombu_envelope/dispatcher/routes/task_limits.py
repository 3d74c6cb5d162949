"""``/queues/{queue}/limits``: limits per task type (docs/protocol.md, section 19)."""

from __future__ import annotations

import json
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, Response
from pydantic import WithJsonSchema

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import LimitOut
from kombu_envelope.dispatcher.problems import Problem, invalid
from kombu_envelope.dispatcher.routes.common import QueueName, blocking, responses, stores
from kombu_envelope.dispatcher.routes.schemas import TaskType
from kombu_envelope.errors import InvalidTaskLimit, Violation
from kombu_envelope.store.task_limits import TaskLimit, parse_limit

router = APIRouter(tags=["limits"])

_SCHEMA = json.loads((FilePath(__file__).resolve().parents[2] / "schemas" /
                      "limits.schema.json").read_text(encoding="utf-8"))
#: The body of a PUT: the limits schema, without its document keys.
LimitBody = Annotated[dict[str, Any], WithJsonSchema(
    {k: v for k, v in _SCHEMA.items() if k not in ("$id", "$schema")})]


def _out(request: Request, queue: str, task_type: str, limit: TaskLimit) -> LimitOut:
    """What the API says of a limit (its breaker's state read from Redis: call off the loop)."""
    state = stores(request).limits.breaker_state(queue, task_type) if limit.breaker else None
    return LimitOut(task_type=task_type, **limit.as_json(), breaker_state=state)


@router.get("/queues/{queue}/limits", response_model=list[LimitOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))], response_model_exclude_none=True)
async def limits_list(request: Request, queue: QueueName) -> list[LimitOut]:
    """The limited task types of a queue, with their limits."""
    def run() -> list[LimitOut]:
        found = stores(request).limits.all(queue)
        return [_out(request, queue, name, limit) for name, limit in found.items()]

    answer: list[LimitOut] = await blocking(run)
    return answer


@router.put("/queues/{queue}/limits/{task_type}", response_model=LimitOut,
            responses=responses(503), dependencies=[Depends(require(Scope.OPERATOR))],
            response_model_exclude_none=True)
async def limits_set(request: Request, queue: QueueName, task_type: TaskType,
                     limit: Annotated[LimitBody, Body(description="the task type's limits")]
                     ) -> LimitOut:
    """Give a task type on a queue these limits, replacing the ones it had; every worker of
    every language applies them at its next read."""
    try:
        parsed = parse_limit(limit)
    except InvalidTaskLimit as exc:
        field = f"limits.{exc.field}" if exc.field else "limits"
        raise invalid([Violation(field, exc.rule, str(exc))]) from exc
    def run() -> LimitOut:
        stores(request).limits.set(queue, task_type, parsed)
        return _out(request, queue, task_type, parsed)

    answer: LimitOut = await blocking(run)
    return answer


@router.delete("/queues/{queue}/limits/{task_type}", status_code=204,
               responses=responses(404, 503), dependencies=[Depends(require(Scope.OPERATOR))])
async def limits_remove(request: Request, queue: QueueName, task_type: TaskType) -> Response:
    """Lift the limits of a task type on a queue."""
    if not await blocking(stores(request).limits.remove, queue, task_type):
        raise Problem(404, "not_found", f"{task_type} has no limits on {queue}")
    return Response(status_code=204)
