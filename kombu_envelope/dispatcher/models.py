"""The JSON the API answers with (and the bodies it takes besides Envelopes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema


class Strict(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class ViolationOut(BaseModel):
    """One broken rule, as :class:`~kombu_envelope.errors.Violation` names it."""

    field: str
    rule: str
    message: str


class ProblemOut(BaseModel):
    """Every error answer."""

    error: str
    message: str
    violations: list[ViolationOut] | None = None
    queue: str | None = None
    task_type: str | None = None
    payload_version: int | None = None
    served: dict[str, list[int]] | None = None


class TaskAccepted(BaseModel):
    """A task taken by ``POST /tasks``."""

    task_id: str
    queue: str
    state: str = Field(description="queued or scheduled (or the state found, for a duplicate)")
    duplicate: bool = Field(description="true when this task was posted before: nothing "
                                        "was enqueued again")
    entry_id: str | None = Field(default=None, description="stream entry id when queued now")


class BatchIn(Strict):
    """``POST /tasks:batch``: tasks for one queue (or each routed by its version)."""

    queue: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[^{}]+$")
    #: Each item is checked on its own (a non-object item is that item's 422).
    tasks: list[Annotated[Any, WithJsonSchema({"$ref": "#/components/schemas/TaskInput"})]]


class BatchItem(BaseModel):
    """The answer for one task of a batch, in the order posted."""

    index: int
    status: int = Field(description="201, 200 (duplicate), 409 or 422, as for POST /tasks")
    task: TaskAccepted | None = None
    problem: ProblemOut | None = None


class BatchOut(BaseModel):
    """Every item's answer."""

    items: list[BatchItem]


class CancelOut(BaseModel):
    """What cancelling did: ``removed`` (from a delayed set), ``marked`` or ``already``."""

    task_id: str
    outcome: str
    queue: str | None = None


class TaskStateOut(BaseModel):
    """What became of a task (docs/protocol.md, section 14)."""

    task_id: str
    state: str
    queue: str | None = None
    task_type: str | None = None
    payload_version: int | None = None
    attempts: int = 0
    retry_count: int = 0
    published_at: str | None = None
    due_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    updated_at: str | None = None
    worker: str | None = None
    language: str | None = None
    host: str | None = None
    pid: int | None = None
    error: str | None = None
    dead_id: str | None = None
    reason: str | None = None


class DelayedCounts(BaseModel):
    """Delayed tasks per queue."""

    queues: dict[str, int]


class DelayedOut(BaseModel):
    """One delayed task."""

    queue: str
    task_id: str
    due: str
    envelope: dict[str, Any] | None = None
    error: str | None = None


class PeriodicOut(BaseModel):
    """One periodic entry and its next run."""

    queue: str
    name: str
    next_run: str | None = None
    fingerprint: str | None = None


class DeadLetterOut(BaseModel):
    """One dead-letter entry: failure fields, raw fields and Envelope."""

    model_config = ConfigDict(extra="allow")

    queue: str
    id: str
    dead_at: str
    raw: dict[str, str]
    envelope: dict[str, Any] | None = None
    decode_error: str | None = None


class DeadLetterCount(BaseModel):
    """Dead letters of one queue, task type and failure class."""

    queue: str
    task_type: str
    failure_class: str
    count: int


class ReplayIn(Strict):
    """How to edit a dead-lettered task before it runs again (all optional)."""

    payload: dict[str, Any] | None = None
    merge_patch: dict[str, Any] | None = Field(default=None,
                                               description="RFC 7386 patch of the payload")
    payload_version: int | None = Field(default=None, ge=1)
    bump_version: bool = False
    retry_count: int = Field(default=0, ge=0)
    max_retries: int | None = Field(default=None, ge=0)


class ReplayOut(BaseModel):
    """The replayed task's new stream entry (none for a dry run)."""

    queue: str
    id: str
    new_id: str | None = Field(description="the new stream entry id; null for a dry run")
    envelope: dict[str, Any] | None = Field(default=None,
                                            description="the edited Envelope, for a dry run")


class PurgeOut(BaseModel):
    """How many dead-letter entries were deleted."""

    queue: str
    purged: int


class SchemaOut(BaseModel):
    """A payload schema."""

    task_type: str
    payload_version: int
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(populate_by_name=True)


class WhoAmIOut(BaseModel):
    """The caller as the dispatcher sees it."""

    name: str = Field(description="the token's name (the client address without tokens)")
    scope: str = Field(description="read, write or operator (operator without tokens)")
    authenticated: bool = Field(description="false when no token is configured")


class WorkerOut(BaseModel):
    """One live or recently seen worker's announcement (docs/protocol.md, section 15)."""

    consumer: str
    language: str
    host: str
    pid: int
    queues: list[str]
    serves: dict[str, list[int]] = Field(description="task type: payload versions "
                                                     "([]: every version)")
    concurrency: int | None = None
    started_at: str | None = None
    seen_at: str | None = None
    stopped_at: str | None = None
    live: bool


class HealthOut(BaseModel):
    """Whether the dispatcher reaches Redis."""

    status: str
    redis: str


class BreakerOut(BaseModel):
    """A task type's circuit breaker (docs/protocol.md, section 19)."""

    failure_ratio: float
    min_attempts: int | None = None
    window_s: float | None = None
    cooldown_s: float | None = None
    probes: int | None = None


class LimitOut(BaseModel):
    """The limits of one task type on one queue (docs/protocol.md, section 19), and the
    state of its circuit breaker when it has one."""

    task_type: str
    concurrency: int | None = None
    rate: float | None = None
    burst: int | None = None
    smooth: bool | None = None
    breaker: BreakerOut | None = None
    breaker_state: Literal["closed", "open", "half_open"] | None = None
