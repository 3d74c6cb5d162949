"""Trace ids: one id follows a request through every task it causes.

Every Envelope has a ``trace_id``. Celery carries it in the ``trace_id``
message header, so a task reads it as ``self.request.trace_id``.

Where a published task's trace id comes from (:func:`propagate_trace_id`):

1. a ``trace_id`` header given explicitly (``apply_async(headers=...)``);
2. :data:`current_trace_id`, which web code sets with :func:`trace` and
   which workers set while a task runs, so child tasks, retries and canvas
   callbacks inherit the trace id of the task that sent them;
3. the current task's ``request.trace_id``;
4. the trace of a ``traceparent`` header, or of the current OpenTelemetry span
   (:mod:`kombu_envelope.trace_context`, which also writes ``traceparent``);
5. otherwise a new id.

Logging: :class:`TraceIdFilter` adds ``record.trace_id`` ("-" when there is
none). Importing ``celery_ext`` installs it on the worker's log handlers, so
putting ``%(trace_id)s`` in ``worker_log_format`` and
``worker_task_log_format`` is all a worker needs; other processes call
:func:`install_log_filter`. The worker's "Task ... received" line, logged
before the task runs, finds the trace id of the delivered message.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

from celery import current_task

from kombu_envelope.random_ids import random_hex
from kombu_envelope.trace_context import current_trace_id as trace_context_id
from kombu_envelope.trace_context import trace_id_of

#: Trace id of the code running now (None: no trace).
current_trace_id: ContextVar[str | None] = ContextVar("current_trace_id", default=None)

#: Text logged as ``%(trace_id)s`` when there is no trace id.
NO_TRACE_ID = "-"

#: Trace ids remembered for delivered tasks that have not run yet.
_RECENT_LIMIT = 10_000


def new_trace_id() -> str:
    """A fresh trace id (32 hex digits, like an Envelope's default)."""
    return random_hex(16)


@contextmanager
def trace(trace_id: str | None = None) -> Iterator[str]:
    """Tasks published inside the block carry ``trace_id`` (a new one if None)::

        with trace(request.headers.get("X-Request-Id")):
            add.delay(2, 2)
    """
    trace_id = trace_id or new_trace_id()
    token = current_trace_id.set(trace_id)
    try:
        yield trace_id
    finally:
        current_trace_id.reset(token)


def _active_trace_id() -> str | None:
    trace_id = current_trace_id.get()
    if trace_id:
        return trace_id
    task = current_task
    request = getattr(task, "request", None) if task else None
    found = getattr(request, "trace_id", None)
    return found if isinstance(found, str) and found else None


def propagate_trace_id(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` receiver: give the task message a ``trace_id`` header.

    Celery logs an exception raised here and publishes the task anyway (it
    would then get a new trace id), so this receiver does not raise.
    """
    if headers is not None and not headers.get("trace_id"):
        headers["trace_id"] = (_active_trace_id() or trace_id_of(headers.get("traceparent"))
                               or trace_context_id() or new_trace_id())


class _RecentTraceIds:
    """Bounded, thread-safe map of task id to trace id of delivered tasks."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, task_id: str, trace_id: str) -> None:
        with self._lock:
            self._ids[task_id] = trace_id
            self._ids.move_to_end(task_id)
            while len(self._ids) > self._limit:
                self._ids.popitem(last=False)

    def get(self, task_id: Any) -> str | None:
        with self._lock:
            return self._ids.get(task_id) if isinstance(task_id, str) else None


_recent = _RecentTraceIds(_RECENT_LIMIT)


def remember_delivery(task_id: str, trace_id: str) -> None:
    """Note the trace id of a task delivered to this process (for its log lines)."""
    _recent.remember(task_id, trace_id)


# Tokens of current_trace_id.set() by task id, to reset at task_postrun.
_tokens: dict[str, Token[str | None]] = {}


def enter_task_trace(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """``task_prerun`` receiver: set :data:`current_trace_id` while the task runs.

    Celery logs an exception raised here and runs the task anyway.
    """
    request = getattr(task, "request", None)
    trace_id = getattr(request, "trace_id", None) or new_trace_id()
    token = current_trace_id.set(trace_id)
    if task_id is not None:
        _tokens[task_id] = token


def exit_task_trace(task_id: str | None = None, **_: Any) -> None:
    """``task_postrun`` receiver: restore :data:`current_trace_id` after the task.

    Celery logs an exception raised here; the task's result is already stored.
    """
    token = _tokens.pop(task_id, None) if task_id is not None else None
    if token is None:
        return
    try:
        current_trace_id.reset(token)
    except ValueError:  # set in another context: nothing to restore here
        current_trace_id.set(None)


class TraceIdFilter(logging.Filter):
    """Adds ``record.trace_id``: the current trace id, or "-" when there is none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "trace_id", None):
            record.trace_id = current_trace_id.get() or _logged_task_trace_id(record) \
                or NO_TRACE_ID
        return True


def _logged_task_trace_id(record: logging.LogRecord) -> str | None:
    # Celery's task log lines carry the task's fields in ``extra={"data": {...}}``.
    data = getattr(record, "data", None)
    return _recent.get(data.get("id")) if isinstance(data, Mapping) else None


def install_log_filter(logger: logging.Logger | None = None) -> None:
    """Add a :class:`TraceIdFilter` to every handler of ``logger`` (default: root), once."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
            handler.addFilter(TraceIdFilter())


def add_log_filter(logger: logging.Logger | None = None, **_: Any) -> None:
    """``after_setup_logger``/``after_setup_task_logger`` receiver: see :func:`install_log_filter`.

    Celery logs an exception raised here and goes on without the filter.
    """
    install_log_filter(logger)
