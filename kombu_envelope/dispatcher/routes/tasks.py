"""``POST /tasks``, ``POST /tasks:batch``, ``GET /tasks/{task_id}``, ``POST
/tasks/{task_id}/cancel``: scheduling, inspecting and cancelling tasks."""

from __future__ import annotations

import hashlib
import json
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic_core import to_json

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import (
    BatchIn,
    BatchOut,
    CancelOut,
    ProblemOut,
    TaskAccepted,
    TaskStateOut,
)
from kombu_envelope.dispatcher.problems import Problem, invalid
from kombu_envelope.dispatcher.routes.common import (
    QueueQuery,
    TaskId,
    blocking,
    config,
    responses,
    stores,
    text_time,
)
from kombu_envelope.dispatcher.stores import Stores
from kombu_envelope.envelope import Envelope, check_publishable
from kombu_envelope.errors import InvalidEnvelope, Violation
from kombu_envelope.store.delayed import Cancellation

router = APIRouter(tags=["tasks"])

#: Namespace of the task ids derived from an ``Idempotency-Key``.
IDEMPOTENCY_NAMESPACE = uuid.UUID("5b0f3c52-5e7d-4a43-9b59-0f7d3b1f2a61")

#: The OpenAPI request body of ``POST /tasks``: an Envelope, or the fields a producer sets.
TASK_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/TaskInput"}}}}}

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1,
                                              max_length=512, pattern=r"^[\x21-\x7e]+$")]


@dataclass(frozen=True)
class Prepared:
    """A task that passed every check, the queue it goes to and its publish token.

    ``new_id``: its ``task_id`` is a random UUID made here, so it cannot have been posted
    before (a task id the body or an ``Idempotency-Key`` gives may have been).
    """

    queue: str
    envelope: Envelope
    token: str
    new_id: bool = False


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> Any:
    """The request body as JSON; a 422 with rule ``json`` when it is not."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid([Violation("envelope", "json", f"the body is not JSON: {exc}")]) from exc


def prepare(found: Stores, data: Any, queue: str | None, key: str | None) -> Prepared:
    """Check one posted task: Envelope rules, its schema, who serves it. Raises
    :class:`Problem` (422, 409)."""
    if not isinstance(data, dict):
        raise invalid([Violation("envelope", "type", "must be a JSON object")])
    if "limits" in data:  # the one name Envelope.new takes for itself
        raise invalid([Violation("limits", "unknown_field", "Extra inputs are not permitted")])
    new_id = key is None and "task_id" not in data
    if key is not None:
        data = {"task_id": str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, key)), **data}
    limits = found.settings.limits
    try:
        envelope = Envelope.new(limits, **data)
        check_publishable(envelope, limits)
        found.schemas.check(envelope)
    except InvalidEnvelope as exc:
        raise invalid(exc.violations) from exc
    queue = found.router.queue_for(queue, envelope.task_type, envelope.payload_version)
    found.settings.keys.queue(queue)  # an invalid queue name is a 422 here
    token = hashlib.sha256(f"{queue}\n{envelope.task_id}\n{key or ''}".encode()).hexdigest()[:32]
    return Prepared(queue, envelope, token, new_id)


def _known_states(found: Stores, items: list[Prepared]) -> list[str | None]:
    """The state of each task that has a record (posted before), else None: one round
    trip for the tasks whose id was given (none when every id is new), then one look per
    task found."""
    given = [item for item in items if not item.new_id]
    if not given:
        return [None] * len(items)
    records = found.records
    pipe = found.client.pipeline(transaction=False)
    for item in given:
        pipe.exists(records.record_key(item.queue, item.envelope.task_id))
    exists = iter(pipe.execute())
    return [None if item.new_id or not next(exists)
            else records.get(item.envelope.task_id, item.queue).state.value
            for item in items]


def _accepted(item: Prepared, state: str | None, entry_id: str | None) -> dict[str, Any]:
    """A :class:`TaskAccepted` as JSON-ready data: the answers are written without a model
    each (a batch of 1,000 spent a tenth of its time building and checking them)."""
    if state is not None and state != "unknown":
        return {"task_id": item.envelope.task_id, "queue": item.queue, "state": state,
                "duplicate": True, "entry_id": None}
    return {"task_id": item.envelope.task_id, "queue": item.queue,
            "state": "queued" if entry_id else "scheduled",  # delayed: no entry
            "duplicate": False, "entry_id": entry_id}


def _json(data: Any, status: int) -> Response:
    """An answer whose body is ``data`` as compact JSON, in the shape its route documents."""
    return Response(to_json(data), status_code=status, media_type="application/json")


def _publish(found: Stores, items: list[Prepared]) -> list[dict[str, Any]]:
    """Publish the tasks not posted before; the answer (a :class:`TaskAccepted`) for each."""
    states = _known_states(found, items)
    fresh = [item for item, state in zip(items, states) if state in (None, "unknown")]
    ids = iter(found.publisher.publish_many(
        [(item.queue, item.envelope) for item in fresh],
        tokens=[item.token for item in fresh], checked=True) if fresh else [])
    return [_accepted(item, state, next(ids) if state in (None, "unknown") else None)
            for item, state in zip(items, states)]


@router.post("/tasks", status_code=201, response_model=TaskAccepted, openapi_extra=TASK_BODY,
             responses={200: {"model": TaskAccepted, "description": "posted before: nothing "
                              "was enqueued again"}, **responses(409, 503)},
             dependencies=[Depends(require(Scope.WRITE))])
async def post_task(request: Request, queue: QueueQuery = None,
                    idempotency_key: IdempotencyKey = None) -> Response:
    """Schedule one task: an Envelope, or the fields a producer sets (``task_id``,
    ``trace_id`` and ``created_at`` are filled in when left out). It is queued now, or
    delayed until its ``schedule_time``. Without ``queue`` it goes to the queue whose
    workers serve its type and version. The same ``task_id`` (or ``Idempotency-Key``,
    from which the task id is derived when the body has none) posted again is answered
    200 and enqueued once."""
    data = parse_json(await request.body())
    found = stores(request)

    def run() -> dict[str, Any]:
        return _publish(found, [prepare(found, data, queue, idempotency_key)])[0]

    accepted: dict[str, Any] = await blocking(run)
    return _json(accepted, 200 if accepted["duplicate"] else 201)


@router.post("/tasks:batch", response_model=BatchOut, responses=responses(503),
             dependencies=[Depends(require(Scope.WRITE))])
async def post_batch(request: Request, batch: BatchIn) -> Response:
    """Schedule many tasks, enqueued in the order posted (a round trip to Redis per
    hundreds of tasks); each is answered on its own (201, 200 for a duplicate, 409 or
    422), in order. At most the configured ``batch_max``."""
    limit = config(request).batch_max
    if len(batch.tasks) > limit:
        raise invalid([Violation("tasks", "length", f"at most {limit} tasks per batch, not "
                                                     f"{len(batch.tasks)}")])
    found = stores(request)
    return _json({"items": await blocking(_batch_answers, found, batch)}, 200)


#: Tasks of a batch checked before they are handed to the publishing thread together.
BATCH_CHUNK = 200


def _batch_answers(found: Stores, batch: BatchIn) -> list[dict[str, Any]]:
    """Each task's answer (a :class:`BatchItem`), in order.

    Tasks are checked a chunk at a time while one thread publishes the chunk before,
    in order: the wait for Redis to store a chunk overlaps the checks of the next
    (which take about as long), where checking every task first and then publishing
    them left Redis and the dispatcher each idle half the time.
    """
    answers: list[dict[str, Any]] = [{}] * len(batch.tasks)

    def publish(ready: list[tuple[int, Prepared]]) -> None:
        for (index, _), accepted in zip(ready, _publish(found, [item for _, item in ready])):
            answers[index] = {"index": index, "status": 200 if accepted["duplicate"] else 201,
                              "task": accepted, "problem": None}

    with ThreadPoolExecutor(1, thread_name_prefix="batch-publish") as sender:
        sent: list[Future[None]] = []
        for start in range(0, len(batch.tasks), BATCH_CHUNK):
            ready: list[tuple[int, Prepared]] = []
            for index in range(start, min(start + BATCH_CHUNK, len(batch.tasks))):
                try:
                    ready.append((index, prepare(found, batch.tasks[index], batch.queue, None)))
                except Problem as problem:
                    answers[index] = {"index": index, "status": problem.status, "task": None,
                                      "problem": ProblemOut(error=problem.error,
                                                            message=problem.message,
                                                            **problem.extra).model_dump()}
            if ready:
                sent.append(sender.submit(publish, ready))
        for future in sent:
            future.result()  # raises what a publish raised (e.g. Redis unreachable: 503)
    return answers


@router.get("/tasks/{task_id}", response_model=TaskStateOut, responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def get_task(request: Request, task_id: TaskId, queue: QueueQuery = None) -> TaskStateOut:
    """What became of a task: its state (``scheduled``, ``queued``, ``running``,
    ``retrying``, ``succeeded``, ``failed``, ``dead``, ``cancelled`` or ``unknown``), times,
    attempts, last error, and the worker and language that ran it."""
    record = await blocking(stores(request).records.get, task_id, queue)
    fields = {name: getattr(record, name) for name in TaskStateOut.model_fields}
    return TaskStateOut.model_validate({
        **{name: text_time(value) if isinstance(value, datetime) else value
           for name, value in fields.items() if value is not None},
        "state": record.state.value})


@router.post("/tasks/{task_id}/cancel", response_model=CancelOut, responses=responses(503),
             dependencies=[Depends(require(Scope.WRITE))])
async def cancel_task(request: Request, task_id: TaskId, queue: QueueQuery = None) -> CancelOut:
    """Cancel a task wherever it is: marked so that no worker runs it, and removed from
    its delayed set (of ``queue``, or of every queue) if it waits there."""
    delayed = stores(request).delayed

    def run() -> Cancellation:
        if queue is None:
            return delayed.cancel_everywhere(task_id)
        return Cancellation(delayed.cancel(task_id, queue), queue)

    found: Cancellation = await blocking(run)
    return CancelOut(task_id=task_id, outcome=found.outcome.value,
                     queue=found.queue if found.outcome.value == "removed" else None)
