"""``/periodic``: periodic entries and their next run."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import PeriodicOut
from kombu_envelope.dispatcher.problems import Problem
from kombu_envelope.dispatcher.routes.common import (
    QueueName,
    QueueQuery,
    blocking,
    responses,
    stores,
    text_time,
)
from kombu_envelope.store.periodic_entries import StoredPeriodicEntry

router = APIRouter(tags=["periodic"])


def _out(entry: StoredPeriodicEntry) -> PeriodicOut:
    return PeriodicOut(queue=entry.queue, name=entry.name, next_run=text_time(entry.next_run),
                       fingerprint=entry.fingerprint)


@router.get("/periodic", response_model=list[PeriodicOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def periodic_list(request: Request, queue: QueueQuery = None) -> list[PeriodicOut]:
    """Every periodic entry (of ``queue``, or of every queue) with its next run."""
    return [_out(entry) for entry in await blocking(stores(request).periodic.list, queue)]


@router.get("/periodic/{queue}/{name}", response_model=PeriodicOut,
            responses=responses(404, 503), dependencies=[Depends(require(Scope.READ))])
async def periodic_show(request: Request, queue: QueueName,
                        name: str = Path(min_length=1, max_length=255)) -> PeriodicOut:
    """One periodic entry and its next run."""
    entry = await blocking(stores(request).periodic.get, queue, name)
    if entry is None:
        raise Problem(404, "not_found", f"no periodic entry {name!r} in queue {queue}")
    return _out(entry)
