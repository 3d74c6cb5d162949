"""Trace context (docs/protocol.md, section 18): ``traceparent`` written at publish, the
``send``/``process`` spans of OpenTelemetry's messaging conventions, and the trace handed
on by a task's own publishes, with and without a tracer provider.

In-process cases give :mod:`kombu_envelope.trace_context` a tracer of a local provider
(no global state); the Celery cases run real ``celery worker`` processes whose spans are
written to a file by ``apps.traced_app``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from apps.envelope_app import create_app
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from kombu_envelope import trace_context
from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.keys import Bucket
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.trace_context import process_span, trace_id_of

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(("value", "trace_id"), [
    (PARENT, PARENT_TRACE),
    ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later", PARENT_TRACE),
    (PARENT + "-more", None),  # version 00 has exactly four fields
    (PARENT.upper(), None),
    ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", None),
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
    (None, None),
])
def test_trace_id_of_takes_only_valid_traceparents(value: Any, trace_id: str | None) -> None:
    assert trace_id_of(value) == trace_id


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace_context, "_tracer", lambda: provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


@pytest.fixture
def queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def publisher(client: redis.Redis, key_prefix: str) -> Publisher:
    return Publisher(client, Settings(key_prefix=key_prefix))


def published(client: redis.Redis, key_prefix: str, queue: str) -> Envelope:
    stream = Settings(key_prefix=key_prefix).keys.queue(queue).stream(Bucket.NORMAL)
    [(_, fields)] = client.xrange(stream)
    return decode_entry(fields)


def test_a_publish_inside_a_span_is_its_send_span_and_carries_it(
        spans: InMemorySpanExporter, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    with trace_context._tracer().start_as_current_span("web request") as web:
        envelope = Envelope.new(task_type="order.close", payload={})
        publisher.publish(queue, envelope)
    web_trace = f"{web.get_span_context().trace_id:032x}"
    [send] = [span for span in spans.get_finished_spans() if span.name == f"send {queue}"]
    assert send.kind is trace.SpanKind.PRODUCER
    assert send.parent.span_id == web.get_span_context().span_id
    assert dict(send.attributes) == {
        "messaging.system": "kombu_envelope", "messaging.operation.type": "send",
        "messaging.operation.name": "send", "messaging.destination.name": queue,
        "messaging.message.id": envelope.task_id, "kombu_envelope.task_type": "order.close"}
    stored = published(client, key_prefix, queue)
    assert stored.headers["traceparent"] == (
        f"00-{web_trace}-{send.context.span_id:016x}-{send.context.trace_flags:02x}")
    assert stored.trace_id == web_trace  # a new task in a trace takes its trace id


def test_publish_iter_gives_each_envelope_its_send_span_ended_with_its_chunk(
        spans: InMemorySpanExporter, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    with trace_context._tracer().start_as_current_span("import job") as job:
        envelopes = [Envelope.new(task_type="order.close") for _ in range(3)]
        publisher.publish_iter((queue, envelope) for envelope in envelopes)
    sends = {span.attributes["messaging.message.id"]: span
             for span in spans.get_finished_spans() if span.name == f"send {queue}"}
    assert set(sends) == {envelope.task_id for envelope in envelopes}
    assert {send.parent.span_id for send in sends.values()} == {job.get_span_context().span_id}
    stream = Settings(key_prefix=key_prefix).keys.queue(queue).stream(Bucket.NORMAL)
    for _, fields in client.xrange(stream):
        stored = decode_entry(fields)
        assert stored.headers["traceparent"].split("-")[2] == (
            f"{sends[stored.task_id].context.span_id:016x}")


def test_publish_iter_ends_the_span_of_a_refused_envelope_as_an_error(
        spans: InMemorySpanExporter, publisher: Publisher, queue: str) -> None:
    fine = Envelope.new(task_type="order.close")
    too_far = Envelope.new(task_type="order.close",
                           schedule_time=utcnow() + timedelta(days=3650))
    with pytest.raises(InvalidEnvelope):
        publisher.publish_iter(iter([(queue, fine), (queue, too_far)]))
    status = {span.attributes["messaging.message.id"]: span.status.status_code
              for span in spans.get_finished_spans() if span.name == f"send {queue}"}
    assert status == {fine.task_id: trace.StatusCode.UNSET,
                      too_far.task_id: trace.StatusCode.ERROR}


def test_a_traceparent_the_caller_set_is_kept(
        spans: InMemorySpanExporter, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    with trace_context._tracer().start_as_current_span("web request"):
        publisher.publish(queue, Envelope.new(task_type="order.close",
                                              headers={"traceparent": PARENT}))
    stored = published(client, key_prefix, queue)
    assert stored.headers == {"traceparent": PARENT}
    assert stored.trace_id == PARENT_TRACE


def test_a_publish_outside_any_trace_starts_one_with_opentelemetry(
        spans: InMemorySpanExporter, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    publisher.publish(queue, Envelope.new(task_type="order.close"))
    [send] = spans.get_finished_spans()
    assert send.parent is None
    assert trace_id_of(published(client, key_prefix, queue).headers["traceparent"]) == (
        f"{send.context.trace_id:032x}")


def test_a_publish_outside_any_trace_without_opentelemetry_writes_none(
        monkeypatch: pytest.MonkeyPatch, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    monkeypatch.setattr(trace_context, "otel_trace", None)
    publisher.publish(queue, Envelope.new(task_type="order.close"))
    assert published(client, key_prefix, queue).headers == {}


def test_without_opentelemetry_a_running_task_hands_its_trace_on(
        monkeypatch: pytest.MonkeyPatch, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    monkeypatch.setattr(trace_context, "otel_trace", None)
    incoming = {"traceparent": PARENT, "tracestate": "vendor=1", "x-tenant": "a"}
    with process_span(queue, "t-1", "order.close", 0, incoming):
        publisher.publish(queue, Envelope.new(task_type="order.next"))
    stored = published(client, key_prefix, queue)
    assert stored.headers == {"traceparent": PARENT, "tracestate": "vendor=1"}
    assert stored.trace_id == PARENT_TRACE


def test_without_a_tracer_provider_no_span_is_started_and_the_trace_is_handed_on(
        monkeypatch: pytest.MonkeyPatch, publisher: Publisher, client: redis.Redis,
        key_prefix: str, queue: str) -> None:
    monkeypatch.setattr(trace_context, "_tracer", lambda: trace.ProxyTracer("test"))
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    started: list[str] = []
    start_span = trace.ProxyTracer.start_span
    monkeypatch.setattr(trace.ProxyTracer, "start_span", lambda self, name, *args, **kwargs: (
        started.append(name), start_span(self, name, *args, **kwargs))[1])
    incoming = {"traceparent": PARENT, "tracestate": "vendor=1"}
    with process_span(queue, "t-1", "order.close", 0, incoming):
        publisher.publish_many([(queue, Envelope.new(task_type="order.next"))])
    assert started == [f"process {queue}"]  # the worker's own span; no send span
    stored = published(client, key_prefix, queue)
    assert stored.headers == incoming
    assert stored.trace_id == PARENT_TRACE


def test_the_process_span_is_a_child_of_the_traceparent_and_records_a_failure(
        spans: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError), process_span("billing", "t-2", "bill.charge", 2,
                                                 {"traceparent": PARENT}):
        raise ValueError("card declined")
    [span] = spans.get_finished_spans()
    assert (span.name, span.kind) == ("process billing", trace.SpanKind.CONSUMER)
    assert f"{span.context.trace_id:032x}" == PARENT_TRACE
    assert span.parent.span_id == 0x00f067aa0ba902b7 and span.parent.is_remote
    assert span.attributes["kombu_envelope.retry_count"] == 2
    assert span.attributes["messaging.operation.type"] == "process"
    assert span.status.status_code is trace.StatusCode.ERROR
    assert [event.name for event in span.events] == ["exception"]


def test_an_invalid_traceparent_is_ignored(spans: InMemorySpanExporter) -> None:
    with process_span("billing", "t-3", "bill.charge", 0, {"traceparent": "00-nonsense"}):
        pass
    [span] = spans.get_finished_spans()
    assert span.parent is None and span.status.status_code is trace.StatusCode.UNSET


# ------------------------------------------------------------- real Celery workers


def worker_env(redis_url: str, prefix: str, spans_file: Path | None) -> dict[str, str]:
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": prefix}
    if spans_file is not None:
        env["TEST_SPANS_FILE"] = str(spans_file)
    return env


def seen(client: redis.Redis, prefix: str, task_id: str) -> dict[str, Any] | None:
    raw = client.get(f"{prefix}:seen:{task_id}")
    return json.loads(raw) if raw else None


def test_one_trace_crosses_a_celery_worker_and_the_task_it_publishes(
        spans: InMemorySpanExporter, redis_url: str, client: redis.Redis,
        tmp_path: Path) -> None:
    prefix = f"t-tr-{uuid.uuid4().hex[:8]}"
    spans_file = tmp_path / "worker-spans.jsonl"
    app = create_app(envelope_url(redis_url), redis_url, prefix)
    with CeleryWorker("apps.traced_app", env=worker_env(redis_url, prefix, spans_file)):
        with trace_context._tracer().start_as_current_span("web request") as web:
            parent = app.send_task("traced.parent", args=["n"])
            failing = app.send_task("traced.fail")
        child_id = parent.get(timeout=20)
        wait_for(lambda: seen(client, prefix, child_id), timeout=20)
        wait_for(lambda: failing.ready(), timeout=20)

        def worker_spans() -> list[dict[str, Any]]:
            return [json.loads(line) for line in spans_file.read_text().splitlines()]

        wait_for(lambda: len(worker_spans()) >= 4, timeout=10)  # 3 process + 1 send
    web_trace = f"{web.get_span_context().trace_id:032x}"
    sends = {span.attributes["messaging.message.id"]: span
             for span in spans.get_finished_spans() if span.name == "send celery"}
    by_task = {(span["name"], span["attributes"]["messaging.message.id"]): span
               for span in worker_spans()}
    ran_parent = by_task["process celery", parent.id]
    assert ran_parent["kind"] == "CONSUMER" and ran_parent["trace_id"] == web_trace
    assert ran_parent["parent_id"] == f"{sends[parent.id].context.span_id:016x}"
    sent_child = by_task["send celery", child_id]
    assert sent_child["parent_id"] == ran_parent["span_id"]
    ran_child = by_task["process celery", child_id]
    assert ran_child["parent_id"] == sent_child["span_id"]
    assert ran_child["trace_id"] == web_trace
    ran_failing = by_task["process celery", failing.id]
    assert ran_failing["status"] == "ERROR" and "exception" in ran_failing["events"]
    child_seen = seen(client, prefix, child_id)
    assert child_seen["traceparent"].startswith(f"00-{web_trace}-{sent_child['span_id']}-")
    assert child_seen["trace_id"] == web_trace


def test_a_celery_worker_without_a_tracer_provider_hands_the_traceparent_on(
        redis_url: str, client: redis.Redis) -> None:
    prefix = f"t-tr-{uuid.uuid4().hex[:8]}"
    app = create_app(envelope_url(redis_url), redis_url, prefix)
    with CeleryWorker("apps.traced_app", env=worker_env(redis_url, prefix, None)):
        parent = app.send_task("traced.parent", args=["n"],
                               headers={"traceparent": PARENT, "tracestate": "vendor=1"})
        child_id = parent.get(timeout=20)
        wait_for(lambda: seen(client, prefix, child_id), timeout=20)
    assert seen(client, prefix, child_id) == {
        "traceparent": PARENT, "tracestate": "vendor=1", "trace_id": PARENT_TRACE}
