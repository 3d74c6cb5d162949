"""``/dead-letters``: list with filters, show, stats, replay with edits, purge: the
operations of ``celery envelope dlq``, through the same :class:`DeadLetters`."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request

from kombu_envelope.dispatcher.config import Scope
from kombu_envelope.dispatcher.guard import require
from kombu_envelope.dispatcher.models import (
    DeadLetterCount,
    DeadLetterOut,
    PurgeOut,
    ReplayIn,
    ReplayOut,
)
from kombu_envelope.dispatcher.problems import Problem, invalid
from kombu_envelope.dispatcher.routes.common import (
    QueueName,
    blocking,
    config,
    responses,
    stores,
    text_time,
)
from kombu_envelope.dispatcher.routes.times import TimeQuery, parse_time
from kombu_envelope.errors import InvalidEnvelope, MalformedEntry, Violation
from kombu_envelope.store.dead_letters import DeadLetter, DeadLetterFilter, ReplayEdit

router = APIRouter(tags=["dead letters"])

EntryId = Annotated[str, Path(pattern=r"^[0-9]{1,19}-[0-9]{1,19}$",
                              description="the dead-letter stream entry id")]
Queues = Annotated[list[str] | None, Query(alias="queue", max_length=100)]
TaskType = Annotated[str | None, Query(max_length=255)]
FailureClass = Annotated[str | None, Query(max_length=64)]


def _where(task_type: str | None, failure_class: str | None, since: str | None,
           until: str | None) -> DeadLetterFilter:
    return DeadLetterFilter(task_type=task_type, failure_class=failure_class,
                            since=parse_time("since", since), until=parse_time("until", until))


def _queues(request: Request, queues: list[str] | None) -> list[str] | None:
    for name in queues or []:
        stores(request).settings.keys.queue(name)  # a name that is no queue is a 422
    return queues or None


def _out(entry: DeadLetter) -> DeadLetterOut:
    data: dict[str, Any] = entry.as_dict()
    return DeadLetterOut(**{**data, "dead_at": text_time(entry.dead_at)})


@router.get("/dead-letters", response_model=list[DeadLetterOut], responses=responses(503),
            dependencies=[Depends(require(Scope.READ))])
async def dead_letters_list(request: Request, queue: Queues = None, task_type: TaskType = None,
                            failure_class: FailureClass = None, since: TimeQuery = None,
                            until: TimeQuery = None,
                            limit: Annotated[int, Query(ge=1)] = 100) -> list[DeadLetterOut]:
    """Dead-letter entries, oldest first, of the given queues (default: every queue),
    filtered by task type, failure class and time (RFC 3339, inclusive)."""
    where = _where(task_type, failure_class, since, until)
    names = _queues(request, queue)
    limit = min(limit, config(request).list_max)
    entries = await blocking(stores(request).dead_letters.list, names, where, limit)
    return [_out(entry) for entry in entries]


@router.get("/dead-letters/stats", response_model=list[DeadLetterCount],
            responses=responses(503), dependencies=[Depends(require(Scope.READ))])
async def dead_letters_stats(request: Request, queue: Queues = None, task_type: TaskType = None,
                             failure_class: FailureClass = None, since: TimeQuery = None,
                             until: TimeQuery = None) -> list[DeadLetterCount]:
    """Counts per queue, task type and failure class."""
    where = _where(task_type, failure_class, since, until)
    counts = await blocking(stores(request).dead_letters.stats, _queues(request, queue), where)
    return [DeadLetterCount(queue=q, task_type=t, failure_class=f, count=n)
            for (q, t, f), n in sorted(counts.items())]


@router.get("/dead-letters/{queue}/{entry_id}", response_model=DeadLetterOut,
            responses=responses(404, 503), dependencies=[Depends(require(Scope.READ))])
async def dead_letter_show(request: Request, queue: QueueName, entry_id: EntryId) -> DeadLetterOut:
    """One entry: failure fields, raw fields (base64 when not UTF-8) and Envelope."""
    entry = await blocking(stores(request).dead_letters.get, queue, entry_id)
    if entry is None:
        raise Problem(404, "not_found", f"no dead-letter entry {entry_id} in queue {queue}")
    return _out(entry)


@router.post("/dead-letters/{queue}/{entry_id}/replay", response_model=ReplayOut,
             responses=responses(404, 503), dependencies=[Depends(require(Scope.OPERATOR))])
async def dead_letter_replay(request: Request, queue: QueueName, entry_id: EntryId,
                             edit: ReplayIn | None = None,
                             dry_run: Annotated[bool, Query(
                                 description="check the edit (every rule and the payload "
                                             "schema) and answer the edited Envelope "
                                             "without publishing it")] = False) -> ReplayOut:
    """Publish a dead-lettered task again, edited first (payload, merge patch, version,
    retries); the edited Envelope must pass every rule (422 otherwise)."""
    edit = edit or ReplayIn()
    replay = ReplayEdit(**edit.model_dump())
    operator = f"dispatcher:{request.state.caller}"
    dead_letters = stores(request).dead_letters

    def run() -> ReplayOut | None:
        try:
            if dry_run:
                envelope = dead_letters.edited(queue, entry_id, replay)
                return None if envelope is None else ReplayOut(
                    queue=queue, id=entry_id, new_id=None,
                    envelope=json.loads(envelope.to_json()))
            new_id = dead_letters.replay(queue, entry_id, replay, operator=operator)
        except MalformedEntry as exc:
            raise invalid([Violation("envelope", "json", exc.reason)]) from exc
        except InvalidEnvelope as exc:
            raise invalid(exc.violations) from exc
        return None if new_id is None else ReplayOut(queue=queue, id=entry_id, new_id=new_id)

    answer: ReplayOut | None = await blocking(run)
    if answer is None:
        raise Problem(404, "not_found", f"no dead-letter entry {entry_id} in queue {queue} "
                                        "(replayed or purged already)")
    return answer


@router.delete("/dead-letters/{queue}", response_model=PurgeOut, responses=responses(503),
               dependencies=[Depends(require(Scope.OPERATOR))])
async def dead_letters_purge(request: Request, queue: QueueName, task_type: TaskType = None,
                             failure_class: FailureClass = None, since: TimeQuery = None,
                             until: TimeQuery = None) -> PurgeOut:
    """Delete the entries of a queue (those matching the filters, if given)."""
    where = _where(task_type, failure_class, since, until)
    purged = await blocking(stores(request).dead_letters.purge, queue, where)
    return PurgeOut(queue=queue, purged=purged)
