"""``GET /whoami``: the caller's token name and scope (what the console may offer)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import WhoAmIOut
from kombu_envelope.dispatcher.routes.common import config, responses

router = APIRouter(tags=["health"])


@router.get("/whoami", response_model=WhoAmIOut, responses=responses(),
            dependencies=[Depends(require(Scope.READ))])
async def whoami(request: Request) -> WhoAmIOut:
    """The caller's token name and scope; without configured tokens every caller has
    scope ``operator``."""
    return WhoAmIOut(name=request.state.caller, scope=request.state.scope.value,
                     authenticated=bool(config(request).tokens))
