"""Celery app for the trace tests (docs/protocol.md, section 18), on ``envelope://``.

Configured from the environment like :mod:`apps.envelope_app`, plus:

* ``TEST_SPANS_FILE`` - when set, each worker process configures OpenTelemetry's SDK
  and appends every finished span to this file, one JSON object per line; unset, no
  tracer provider is configured (OpenTelemetry's API does nothing).

``traced.parent`` publishes ``traced.child``; ``traced.child`` stores the trace headers
it was delivered with under ``<prefix>:seen:<task_id>`` in the result Redis;
``traced.fail`` raises.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import redis
from celery import Task
from celery.signals import worker_init, worker_process_init

from apps.envelope_app import create_app

app = create_app()
PREFIX = os.environ.get("TEST_KEY_PREFIX", "envelope")


class JsonLinesExporter:
    """A span exporter appending each span's identity and attributes to a file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self.lock, open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                out.write(json.dumps({
                    "name": span.name, "kind": span.kind.name,
                    "trace_id": f"{span.context.trace_id:032x}",
                    "span_id": f"{span.context.span_id:016x}",
                    "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                    "status": span.status.status_code.name,
                    "attributes": dict(span.attributes or {}),
                    "events": [event.name for event in span.events],
                }) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to release."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Spans are written when exported."""
        return True


_configured_in: list[int] = []


@worker_init.connect  # the solo pool runs tasks in the worker's own process
@worker_process_init.connect  # each prefork child
def configure_tracing(**_: Any) -> None:
    """Give this worker process a tracer provider writing to ``TEST_SPANS_FILE``."""
    path = os.environ.get("TEST_SPANS_FILE")
    if not path or os.getpid() in _configured_in:
        return
    _configured_in.append(os.getpid())
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)


def _results() -> redis.Redis:
    return redis.Redis.from_url(os.environ.get("TEST_RESULT_BACKEND", "redis://"))


@app.task(name="traced.parent", shared=False)
def parent(note: str) -> str:
    """Publish ``traced.child`` from inside the task; answer its task id."""
    return str(child.delay(note).id)


@app.task(name="traced.child", shared=False, bind=True)
def child(self: Task, note: str) -> str:
    """Keep the trace headers this task was delivered with."""
    headers = self.request.headers or {}
    seen = {name: headers.get(name) for name in ("traceparent", "tracestate")}
    seen["trace_id"] = self.request.trace_id
    _results().set(f"{PREFIX}:seen:{self.request.id}", json.dumps(seen), ex=600)
    return note


@app.task(name="traced.fail", shared=False)
def fail() -> None:
    """Fail at once (no retry is asked for)."""
    raise RuntimeError("traced failure")
