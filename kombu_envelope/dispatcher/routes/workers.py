"""``GET /workers``: the live and recently seen workers, from their announcements."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import WorkerOut
from kombu_envelope.dispatcher.routes.common import (
    QueueQuery,
    blocking,
    responses,
    stores,
    text_time,
)
from kombu_envelope.store.announcements import WorkerAnnouncement

router = APIRouter(tags=["workers"])


def _out(worker: WorkerAnnouncement) -> WorkerOut:
    return WorkerOut(consumer=worker.consumer, language=worker.language, host=worker.host,
                     pid=worker.pid, queues=worker.queues, serves=worker.serves,
                     concurrency=worker.concurrency, started_at=text_time(worker.started_at),
                     seen_at=text_time(worker.seen_at), stopped_at=text_time(worker.stopped_at),
                     live=worker.live)


@router.get("/workers", response_model=list[WorkerOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def workers_list(request: Request, queue: QueueQuery = None) -> list[WorkerOut]:
    """Live and recently seen workers (of ``queue`` if given), by consumer name: what
    each serves (task types and payload versions) and whether it is live."""
    found: list[WorkerAnnouncement] = await blocking(stores(request).announcements.workers, queue)
    return [_out(worker) for worker in found]
