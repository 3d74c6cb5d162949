"""``GET /metrics``: Prometheus' text format, read from Redis at each scrape (read scope).

Left out of the OpenAPI document: its answer is Prometheus' text format, not JSON
(docs/monitoring/metrics.md describes it).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from redis.exceptions import RedisError

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.metrics import CONTENT_TYPE, render
from kombu_envelope.dispatcher.problems import Problem
from kombu_envelope.dispatcher.routes.common import blocking, stores

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(require(Scope.READ))])
async def metrics(request: Request) -> Response:
    """Every figure of docs/monitoring/metrics.md; 503 when Redis cannot be read."""
    found = stores(request)
    try:
        page = await blocking(render, found.client, found.settings)
    except RedisError as exc:
        raise Problem(503, "redis_unavailable",
                      f"Redis cannot be read, so there are no metrics: {exc}") from exc
    return Response(page, media_type=CONTENT_TYPE)
