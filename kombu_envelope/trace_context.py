"""W3C Trace Context in Envelope headers, and OpenTelemetry spans when it is installed.

docs/protocol.md, section 18. A publish writes ``headers.traceparent`` (and
``tracestate``) from the current trace unless the caller set them: the current
OpenTelemetry span, or else the task this process is running (so a worker
without OpenTelemetry hands the trace on unchanged). A worker makes the trace of
the task it runs current while it runs (:func:`process_span`).

With the ``otel`` extra (``opentelemetry-api``) and a tracer provider configured,
every publish is a ``PRODUCER`` span ``send <queue>`` and every attempt a
``CONSUMER`` span ``process <queue>``, with the messaging semantic conventions'
attributes. Without a provider, OpenTelemetry's API does nothing and the headers
are still handed on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, partial
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - the otel extra is optional
    otel_trace = None  # type: ignore[assignment]

#: Envelope headers that carry the trace context.
TRACE_HEADERS = ("traceparent", "tracestate")
#: ``messaging.system`` of every span.
MESSAGING_SYSTEM = "kombu_envelope"

# version "00"-"fe", trace id, parent id, flags; all lower-case hex (W3C Trace Context).
_TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})([0-9a-f]{32})-(?!0{16})[0-9a-f]{16}"
                          r"-[0-9a-f]{2}(-.*)?$")

# The trace headers of the task this process is running now (None: none).
_running: ContextVar[Mapping[str, str] | None] = ContextVar("envelope_running_trace",
                                                            default=None)


def trace_id_of(traceparent: Any) -> str | None:
    """The 32-hex trace id of a valid ``traceparent``, else None (an invalid one is ignored)."""
    if not isinstance(traceparent, str):
        return None
    match = _TRACEPARENT.match(traceparent)
    if match is None or (traceparent.startswith("00-") and match.group(2)):
        return None  # version 00 has exactly four fields
    return match.group(1)


def current_trace_id() -> str | None:
    """The trace id of the current OpenTelemetry span, else of the task being run."""
    span_context = _current_span_context()
    if span_context is not None:
        return f"{span_context.trace_id:032x}"
    running = _running.get()
    return trace_id_of(running.get("traceparent")) if running else None


def write_trace_headers(headers: MutableMapping[str, str]) -> None:
    """Fill in ``traceparent``/``tracestate`` from the current trace, unless set already."""
    if not headers.get("traceparent"):
        headers.update(current_trace_headers())


def current_trace_headers() -> dict[str, str]:
    """``traceparent``/``tracestate`` of the current trace (empty outside of one)."""
    if _current_span_context() is not None:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return {name: carrier[name] for name in TRACE_HEADERS if name in carrier}
    running = _running.get()
    if running and trace_id_of(running.get("traceparent")):
        return {name: running[name] for name in TRACE_HEADERS if running.get(name)}
    return {}


def _current_span_context() -> Any:
    if otel_trace is None:
        return None
    span_context = otel_trace.get_current_span().get_span_context()
    return span_context if span_context.is_valid else None


def _tracing() -> bool:
    """False when no tracer provider is configured: spans would then record nothing and
    carry their parent's context, which the headers get without them."""
    tracer = _tracer()
    if isinstance(tracer, otel_trace.NoOpTracer):
        return False
    return not (isinstance(tracer, otel_trace.ProxyTracer) and isinstance(
        otel_trace.get_tracer_provider(),
        (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)))


@cache
def _tracer() -> Any:
    # A proxy until a tracer provider is set, which it then follows.
    return otel_trace.get_tracer("kombu_envelope")


def _attributes(operation: str, queue: str, task_id: str, task_type: str) -> dict[str, Any]:
    return {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": queue,
        "messaging.message.id": task_id,
        "kombu_envelope.task_type": task_type,
    }


class SendSpan:
    """The ``send <queue>`` span of one publish (a no-op without OpenTelemetry or
    without a tracer provider: the headers are then the current trace's)."""

    def __init__(self, queue: str, task_id: str, task_type: str, *,
                 tracing: bool | None = None,
                 inherited: Mapping[str, str] | None = None) -> None:
        """``tracing``: whether a tracer provider is configured, when the caller knows;
        ``inherited``: the current trace's headers (:func:`current_trace_headers`), when
        the caller read them already."""
        self.span = None
        self._inherited = inherited
        if otel_trace is not None and (_tracing() if tracing is None else tracing):
            self.span = _tracer().start_span(
                f"send {queue}", kind=otel_trace.SpanKind.PRODUCER,
                attributes=_attributes("send", queue, task_id, task_type))

    def write_headers(self, headers: MutableMapping[str, str]) -> None:
        """Write this span's context (or the current trace's) into ``headers``."""
        if headers.get("traceparent"):
            return
        if self.span is None:
            headers.update(current_trace_headers() if self._inherited is None
                           else self._inherited)
            return
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(
            carrier, context=otel_trace.set_span_in_context(self.span))
        if "traceparent" in carrier:
            headers.update({name: carrier[name] for name in TRACE_HEADERS if name in carrier})
        else:  # no tracer provider: the span is not recording, hand the trace on
            write_trace_headers(headers)

    def end(self, error: BaseException | None = None) -> None:
        """End the span; ``error`` (the publish failed) marks it ERROR."""
        if self.span is None:
            return
        if error is not None:
            _record_error(self.span, error)
        self.span.end()


def send_span_maker() -> Callable[[str, str, str], SendSpan]:
    """A maker of the spans of many publishes, called with ``(queue, task_id,
    task_type)``: whether a tracer provider is configured is asked once, when it is made."""
    if otel_trace is not None and _tracing():
        return partial(SendSpan, tracing=True)
    # Without spans every publish hands on the same current trace, read once: one no-op
    # span serves them all.
    untraced = SendSpan("", "", "", tracing=False, inherited=current_trace_headers())
    return lambda _queue, _task_id, _task_type: untraced


def send_spans(publishes: list[tuple[str, str, str]]) -> list[SendSpan]:
    """The spans of many publishes, each ``(queue, task_id, task_type)`` (see
    :func:`send_span_maker`)."""
    make = send_span_maker()
    return [make(queue, task_id, task_type) for queue, task_id, task_type in publishes]


@contextmanager
def process_span(queue: str, task_id: str, task_type: str, retry_count: int,
                 headers: Mapping[str, Any]) -> Iterator[None]:
    """Run one attempt inside its trace: the ``process <queue>`` span, child of the
    task's ``traceparent``, is current, and tasks published inside hand the trace on.

    An exception raised inside marks the span ERROR, records it, and propagates.
    """
    trace_headers = {name: value for name in TRACE_HEADERS
                     if isinstance(value := headers.get(name), str)}
    if not trace_id_of(trace_headers.get("traceparent")):
        trace_headers = {}
    token = _running.set(trace_headers or None)
    try:
        if otel_trace is None:
            yield
            return
        parent = TraceContextTextMapPropagator().extract(trace_headers)
        attributes = {**_attributes("process", queue, task_id, task_type),
                      "kombu_envelope.retry_count": retry_count}
        span = _tracer().start_span(f"process {queue}", context=parent,
                                    kind=otel_trace.SpanKind.CONSUMER, attributes=attributes)
        attached = otel_context.attach(otel_trace.set_span_in_context(span, parent))
        try:
            yield
        except BaseException as exc:
            _record_error(span, exc)
            raise
        finally:
            otel_context.detach(attached)
            span.end()
    finally:
        _running.reset(token)


def _record_error(span: Any, error: BaseException) -> None:
    span.record_exception(error)
    span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, f"{type(error).__name__}"))
