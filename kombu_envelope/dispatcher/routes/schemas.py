"""``/schemas``: the payload schema registry (docs/protocol.md, section 16)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Request, Response

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import SchemaOut
from kombu_envelope.dispatcher.problems import Problem, invalid
from kombu_envelope.dispatcher.routes.common import blocking, responses, stores
from kombu_envelope.envelope import MAX_SAFE_INTEGER, TASK_TYPE_PATTERN
from kombu_envelope.errors import EnvelopeError, Violation

router = APIRouter(tags=["schemas"])

TaskType = Annotated[str, Path(min_length=1, max_length=255, pattern=TASK_TYPE_PATTERN)]
Version = Annotated[int, Path(ge=1, le=MAX_SAFE_INTEGER)]


@router.get("/schemas", response_model=list[SchemaOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def schemas_list(request: Request) -> list[SchemaOut]:
    """Every registered payload schema."""
    found: dict[tuple[str, int], dict[str, Any]] = await blocking(stores(request).schemas.all)
    return [SchemaOut(task_type=t, payload_version=v, schema=s)
            for (t, v), s in sorted(found.items())]


@router.get("/schemas/{task_type}/{payload_version}", response_model=SchemaOut,
            responses=responses(404, 503), dependencies=[Depends(require(Scope.READ))])
async def schema_show(request: Request, task_type: TaskType,
                      payload_version: Version) -> SchemaOut:
    """The schema of one task type and payload version."""
    schema = await blocking(stores(request).schemas.get, task_type, payload_version)
    if schema is None:
        raise Problem(404, "not_found", f"no schema for {task_type} version {payload_version}")
    return SchemaOut(task_type=task_type, payload_version=payload_version, schema=schema)


@router.post("/schemas/{task_type}/{payload_version}", response_model=SchemaOut,
            responses=responses(503), dependencies=[Depends(require(Scope.WRITE))])
async def schema_register(request: Request, task_type: TaskType, payload_version: Version,
                          schema: Annotated[dict[str, Any], Body(
                              description="a JSON Schema, draft 2020-12")]) -> SchemaOut:
    """Register (or replace) the schema of a task type and payload version; every
    producer and worker enforces it within ``schema_cache_s``."""

    def run() -> None:
        try:
            stores(request).schemas.register(task_type, payload_version, schema)
        except EnvelopeError as exc:  # InvalidSchema: not valid draft 2020-12
            raise invalid([Violation("schema", "schema", str(exc))]) from exc

    await blocking(run)
    return SchemaOut(task_type=task_type, payload_version=payload_version, schema=schema)


@router.delete("/schemas/{task_type}/{payload_version}", status_code=204,
               responses=responses(404, 503), dependencies=[Depends(require(Scope.WRITE))])
async def schema_delete(request: Request, task_type: TaskType,
                        payload_version: Version) -> Response:
    """Delete a schema: tasks of that type and version are no longer checked."""
    if not await blocking(stores(request).schemas.delete, task_type, payload_version):
        raise Problem(404, "not_found", f"no schema for {task_type} version {payload_version}")
    return Response(status_code=204)
