"""``GET /healthz``: whether the dispatcher reaches Redis (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from redis.exceptions import RedisError

from kombu_envelope.dispatcher.models import HealthOut
from kombu_envelope.dispatcher.problems import Problem
from kombu_envelope.dispatcher.routes.common import blocking, responses, stores

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, responses=responses(503))
async def healthz(request: Request) -> HealthOut:
    """``ok`` when Redis answers a PING."""
    client = stores(request).client
    try:
        await blocking(client.ping)
    except RedisError as exc:
        raise Problem(503, "redis_unavailable", "Redis cannot be reached") from exc
    return HealthOut(status="ok", redis="ok")
