"""``/delayed``: delayed tasks by queue and due time; show and cancel one."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import CancelOut, DelayedCounts, DelayedOut
from kombu_envelope.dispatcher.problems import Problem
from kombu_envelope.dispatcher.routes.common import (
    QueueName,
    TaskId,
    blocking,
    config,
    responses,
    stores,
    text_time,
)
from kombu_envelope.dispatcher.routes.times import TimeQuery, parse_time
from kombu_envelope.store.delayed import DelayedTask

router = APIRouter(tags=["delayed"])


def _out(task: DelayedTask) -> DelayedOut:
    return DelayedOut(queue=task.queue, task_id=task.task_id, due=text_time(task.due) or "",
                      envelope=json.loads(task.envelope.to_json()) if task.envelope else None,
                      error=task.error)


@router.get("/delayed", response_model=DelayedCounts, responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def delayed_counts(request: Request) -> DelayedCounts:
    """How many tasks are delayed, per queue."""
    return DelayedCounts(queues=await blocking(stores(request).delayed.counts))


@router.get("/delayed/{queue}", response_model=list[DelayedOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def delayed_list(request: Request, queue: QueueName, due_after: TimeQuery = None,
                       due_before: TimeQuery = None,
                       task_type: Annotated[str | None, Query(max_length=255)] = None,
                       limit: Annotated[int, Query(ge=1)] = 100) -> list[DelayedOut]:
    """The delayed tasks of a queue, soonest first, due within ``[due_after, due_before]``
    (RFC 3339 times with an offset), of one ``task_type`` if given."""
    low, high = parse_time("due_after", due_after), parse_time("due_before", due_before)
    limit = min(limit, config(request).list_max)

    def run() -> list[DelayedOut]:
        found: list[DelayedOut] = []
        for task in stores(request).delayed.iter_all(queue):
            if (high is not None and task.due > high) or len(found) >= limit:
                break
            if (low is not None and task.due < low) or (task_type is not None and (
                    task.envelope is None or task.envelope.task_type != task_type)):
                continue
            found.append(_out(task))
        return found

    result: list[DelayedOut] = await blocking(run)
    return result


@router.get("/delayed/{queue}/{task_id}", response_model=DelayedOut, responses=responses(404, 503),
            dependencies=[Depends(require(Scope.READ))])
async def delayed_show(request: Request, queue: QueueName, task_id: TaskId) -> DelayedOut:
    """One delayed task with its Envelope."""
    task = await blocking(stores(request).delayed.get, task_id, queue)
    if task is None:
        raise Problem(404, "not_found", f"no delayed task {task_id} in queue {queue}")
    return _out(task)


@router.post("/delayed/{queue}/{task_id}/cancel", response_model=CancelOut,
             responses=responses(503), dependencies=[Depends(require(Scope.WRITE))])
async def delayed_cancel(request: Request, queue: QueueName, task_id: TaskId) -> CancelOut:
    """Cancel a task, looking for it in this queue's delayed set only (it is marked
    cancelled whatever is found)."""
    outcome = await blocking(stores(request).delayed.cancel, task_id, queue)
    return CancelOut(task_id=task_id, outcome=outcome.value,
                     queue=queue if outcome.value == "removed" else None)
