"""Celery protocol 2 <-> Envelope mapping (no Redis: messages are captured in memory)."""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.backends.base import BaseBackend
from celery.worker.request import Request
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.message import Message
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import memory as memory_transport
from kombu.utils.json import loads as kombu_loads

import celery_ext
from celery_ext.arguments import BoundArguments, bind
from celery_ext.headers import HARD_LIMIT_GRACE_S
from celery_ext.priority import UNSET_PRIORITY_PROPERTY, to_celery_priority, to_envelope_priority
from celery_ext.protocol import CeleryAdapter, serve_worker_app, set_worker_app
from celery_ext.tracing import TraceIdFilter, trace
from celery_ext.transport import Transport
from kombu_envelope.envelope import DEFAULT_LIMITS, Envelope
from kombu_envelope.errors import InvalidEnvelope, UnsupportedMessage, Violation
from kombu_envelope.kombu.adapter import ENVELOPE_CONTENT_TYPE, Undeliverable

ADAPTER = CeleryAdapter()
AMSTERDAM_SUMMER = timezone(timedelta(hours=2))
# Properties the transport owns; they are not part of a task.
TRANSPORT_PROPERTIES = {"delivery_info", "delivery_tag", "body_encoding", UNSET_PRIORITY_PROPERTY}


def make_app(name: str = "proto", **conf: Any) -> Celery:
    """A finalized app, current in this thread, whose tasks the adapter binds against."""
    app = Celery(name, broker="memory://", backend="cache+memory://", set_as_current=True)
    app.conf.update(conf)

    @app.task(name="proto.add", shared=False, max_retries=5)
    def add(x: Any, y: Any) -> Any:
        return x + y

    @app.task(name="proto.bound", shared=False, bind=True)
    def bound(self: Any, a: Any, b: Any = 2) -> Any:
        return a

    @app.task(name="proto.collect", shared=False)
    def collect(first: Any, *rest: Any, **options: Any) -> Any:
        return first

    @app.task(name="proto.positional_only", shared=False)
    def positional_only(a: Any, /, **options: Any) -> Any:
        return a

    @app.task(name="proto.v2", shared=False, payload_versions=(2, 3))
    def v2(**payload: Any) -> Any:
        return payload

    @app.task(name="proto.unlimited", shared=False, max_retries=None)
    def unlimited() -> None:
        return None

    app.finalize()
    return app


@pytest.fixture
def app() -> Iterator[Celery]:
    """The app of the publisher, and of the worker this process pretends to be."""
    app = make_app()
    set_worker_app(app)
    yield app
    set_worker_app(None)
    app.close()


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Messages the memory transport was asked to store, in order."""
    messages: list[dict[str, Any]] = []

    def capture(channel: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        messages.append(message)

    monkeypatch.setattr(memory_transport.Channel, "_put", capture)
    return messages


def body_of(message: dict[str, Any]) -> bytes:
    """The body as the envelope:// channel hands it to the adapter."""
    return base64.b64decode(message["body"])


def store(message: dict[str, Any]) -> Envelope:
    """The Envelope as read back from Redis: encoded, then parsed from its JSON."""
    envelope = ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)
    assert envelope is not None
    return Envelope.parse(envelope.to_json())


def assert_lossless(message: dict[str, Any]) -> tuple[Envelope, dict[str, Any]]:
    """Publish -> store -> deliver gives back the same task message."""
    envelope = store(message)
    delivered = ADAPTER.to_message(envelope, "celery")
    assert json.loads(delivered["body"]) == json.loads(body_of(message))
    assert delivered["headers"] == message["headers"]
    assert delivered["content-type"] == message["content-type"] == "application/json"
    expected = {k: v for k, v in message["properties"].items() if k not in TRANSPORT_PROPERTIES}
    if message["properties"].get(UNSET_PRIORITY_PROPERTY):
        expected["priority"] = None
    got = {k: v for k, v in delivered["properties"].items() if k not in TRANSPORT_PROPERTIES}
    assert got == expected
    return envelope, delivered


def celery_request(app: Celery, delivered: dict[str, Any]) -> Request:
    """The worker's view of a delivered message."""
    message = Message(
        body=delivered["body"], content_type=delivered["content-type"],
        content_encoding=delivered["content-encoding"], headers=delivered["headers"],
        properties=delivered["properties"], delivery_info={"routing_key": "celery"},
    )
    return Request(message, app=app, task=app.tasks[delivered["headers"]["task"]])


# ------------------------------------------------------------------ arguments


def test_positional_args_are_named_with_the_task_signature(app: Celery, published: list) -> None:
    app.tasks["proto.add"].delay(2, 3)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.payload == {"x": 2, "y": 3}
    assert envelope.ext["celery"]["argnames"] == ["x", "y"]
    assert "args" not in envelope.ext["celery"]
    assert json.loads(delivered["body"])[:2] == [[2, 3], {}]


def test_bound_task_names_args_without_self(app: Celery, published: list) -> None:
    app.tasks["proto.bound"].apply_async((1,), {"b": 4})
    envelope, _ = assert_lossless(published[0])
    assert envelope.payload == {"a": 1, "b": 4}
    assert envelope.ext["celery"]["argnames"] == ["a"]


def test_keyword_arguments_are_the_payload(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async(kwargs={"y": 1, "x": 2})
    envelope, _ = assert_lossless(published[0])
    assert envelope.payload == {"y": 1, "x": 2}
    assert "argnames" not in envelope.ext["celery"]


def test_varargs_extras_stay_positional(app: Celery, published: list) -> None:
    app.tasks["proto.collect"].apply_async((1, 2, 3), {"k": 4})
    envelope, _ = assert_lossless(published[0])
    assert envelope.payload == {"first": 1, "k": 4}
    assert envelope.ext["celery"]["args"] == [2, 3]


def test_positional_only_parameters_are_named_and_passed_positionally(
        app: Celery, published: list) -> None:
    app.tasks["proto.positional_only"].apply_async((1,), {"b": 2})
    envelope, delivered = assert_lossless(published[0])
    assert envelope.payload == {"a": 1, "b": 2}
    assert celery_request(app, delivered).args == [1]


def test_args_of_unregistered_tasks_stay_positional(app: Celery, published: list) -> None:
    app.send_task("elsewhere.run", args=[1, [2]], kwargs={"k": "v"})
    envelope = store(published[0])
    assert envelope.payload == {"k": "v"}
    assert envelope.ext["celery"]["args"] == [1, [2]]
    assert envelope.max_retries == 3

    @app.task(name="elsewhere.run", shared=False)  # the worker knows the task
    def run(a: Any, b: Any, k: Any) -> None:
        return None

    delivered = ADAPTER.to_message(envelope, "celery")
    assert json.loads(delivered["body"]) == json.loads(body_of(published[0]))


def test_a_signature_read_once_serves_each_function_and_an_unhashable_run_binds_too() -> None:
    class Runner:  # a callable object without a hash: its signature is read every time
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, a: Any, b: Any = 0) -> None:
            return None

    def other(c: Any, d: Any) -> None:
        return None

    assert bind(Runner(), (1, 2), {}).argnames == ["a", "b"]
    for _ in range(2):
        assert bind(other, (1,), {"d": 2}) == BoundArguments({"c": 1, "d": 2}, ["c"], [])


@pytest.mark.parametrize(("args", "kwargs"), [
    ([1, 2, 3], {}),        # too many arguments
    ([1], {"x": 2}),        # a name also given as a keyword
])
def test_args_that_do_not_bind_stay_positional(app: Celery, published: list, args: list,
                                               kwargs: dict) -> None:
    app.send_task("proto.add", args=args, kwargs=kwargs)
    envelope, _ = assert_lossless(published[0])
    assert envelope.payload == kwargs
    assert envelope.ext["celery"]["args"] == args


def test_kombu_typed_values_round_trip_untouched(app: Celery, published: list) -> None:
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    ident = uuid.uuid4()
    app.tasks["proto.add"].delay(when, {"id": ident, "price": Decimal("1.10")})
    envelope, delivered = assert_lossless(published[0])
    assert envelope.payload["x"]["__type__"] == "datetime"
    args, _, _ = kombu_loads(delivered["body"])
    assert args == [when, {"id": ident, "price": Decimal("1.10")}]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(json_values, min_size=1, max_size=4),
       kwargs=st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k != "first"),
                              json_values, max_size=3))
def test_any_json_call_round_trips(args: list, kwargs: dict) -> None:
    app = make_app("proto_hypothesis")
    try:
        headers, properties, body, _ = app.amqp.as_task_v2(
            str(uuid.uuid4()), "proto.collect", args, kwargs)
        message = {"body": base64.b64encode(json.dumps(body).encode()).decode(),
                   "content-type": "application/json", "content-encoding": "utf-8",
                   "headers": {**headers, "trace_id": "t-1"},
                   "properties": {**properties, "priority": 4}}
        envelope, _ = assert_lossless(message)
        assert envelope.payload["first"] == args[0]
    finally:
        app.close()


# ------------------------------------------------------------- other fields


def test_eta_with_offset_is_the_schedule_time(app: Celery, published: list) -> None:
    eta = datetime(2030, 6, 1, 12, 30, 0, 123456, tzinfo=AMSTERDAM_SUMMER)
    app.tasks["proto.add"].apply_async((1, 2), eta=eta)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.schedule_time == eta
    assert delivered["headers"]["eta"] == "2030-06-01T12:30:00.123456+02:00"
    assert celery_request(app, delivered).eta == eta


def test_countdown_becomes_an_aware_schedule_time(app: Celery, published: list) -> None:
    before = datetime.now(timezone.utc)
    app.tasks["proto.add"].apply_async((1, 2), countdown=60)
    envelope, _ = assert_lossless(published[0])
    assert envelope.schedule_time is not None
    assert before + timedelta(seconds=59) < envelope.schedule_time < before + timedelta(minutes=2)


def test_naive_eta_is_refused_naming_schedule_time(app: Celery, published: list) -> None:
    # Celery 5.7 publishes a naive eta as it is, without an offset.
    app.tasks["proto.add"].apply_async((1, 2), eta=datetime(2030, 1, 1, 9, 0))
    message = published[0]
    assert message["headers"]["eta"] == "2030-01-01T09:00:00"
    with pytest.raises(InvalidEnvelope) as raised:
        ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)
    assert raised.value.fields == ["schedule_time"]
    assert raised.value.rules == ["timezone_required"]


def test_expires_is_the_envelope_field(app: Celery, published: list) -> None:
    before = datetime.now(timezone.utc)
    app.tasks["proto.add"].apply_async((1, 2), expires=60)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.expires is not None
    assert before + timedelta(seconds=59) < envelope.expires < before + timedelta(minutes=2)
    assert "expires" not in envelope.ext["celery"]["headers"]
    assert delivered["properties"]["expiration"] == "60000"
    assert celery_request(app, delivered).expires == envelope.expires


def test_expires_with_offset_round_trips(app: Celery, published: list) -> None:
    expires = datetime(2030, 6, 1, 12, 30, 0, 123456, tzinfo=AMSTERDAM_SUMMER)
    app.tasks["proto.add"].apply_async((1, 2), expires=expires)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.expires == expires
    assert b'"expires":"2030-06-01T12:30:00.123456+02:00"' in envelope.to_json()
    assert delivered["headers"]["expires"] == "2030-06-01T12:30:00.123456+02:00"


def test_naive_expires_is_refused_naming_expires(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async((1, 2), expires=datetime(2030, 1, 1, 9, 0))
    message = published[0]
    assert message["headers"]["expires"] == "2030-01-01T09:00:00"
    with pytest.raises(InvalidEnvelope) as raised:
        ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)
    assert raised.value.fields == ["expires"]
    assert raised.value.rules == ["timezone_required"]


def test_expires_of_another_language_is_celerys_expires(app: Celery) -> None:
    envelope = Envelope.new(task_type="proto.add", payload={"x": 1, "y": 2},
                            expires="2020-01-01T08:00:00+08:00")
    delivered = ADAPTER.to_message(envelope, "celery")
    assert delivered["headers"]["expires"] == "2020-01-01T08:00:00+08:00"
    request = celery_request(app, delivered)
    assert request.expires == datetime(2020, 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize(("limits", "timeout_ms"), [
    ({"time_limit": 10, "soft_time_limit": 5}, 5_000),
    ({"soft_time_limit": 2.5}, 2_500),
    ({}, None),
])
def test_time_limits_become_timeout_ms(app: Celery, published: list, limits: dict,
                                       timeout_ms: int | None) -> None:
    app.tasks["proto.add"].apply_async((1, 2), **limits)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.timeout_ms == timeout_ms
    assert delivered["headers"]["timelimit"] == [limits.get("time_limit"),
                                                 limits.get("soft_time_limit")]


def test_a_hard_limit_alone_becomes_the_soft_limit(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async((1, 2), time_limit=10)
    envelope = store(published[0])
    assert envelope.timeout_ms == 10_000
    delivered = ADAPTER.to_message(envelope, "celery")
    assert delivered["headers"]["timelimit"] == [10 + HARD_LIMIT_GRACE_S, 10]


def test_retries_above_max_retries_keep_the_envelope_valid(app: Celery, published: list) -> None:
    app.send_task("proto.add", args=[1, 2], retries=7)
    envelope, delivered = assert_lossless(published[0])
    assert (envelope.retry_count, envelope.max_retries) == (7, 7)
    assert envelope.ext["celery"]["max_retries"] == 7  # as written: a later change shows
    assert "max_retries" not in delivered["headers"]  # the task's max_retries decides
    assert delivered["headers"]["retries"] == 7


@pytest.mark.parametrize("max_retries", [0, None, 9])
def test_max_retries_of_another_language_caps_celery_and_survives_a_retry(
        app: Celery, published: list, max_retries: int | None) -> None:
    foreign = Envelope.new(task_type="proto.add", payload={"x": 1, "y": 2},
                           max_retries=max_retries)
    delivered = ADAPTER.to_message(foreign, "celery")
    assert delivered["headers"]["max_retries"] == max_retries  # the cap, not the task's 5
    request = celery_request(app, delivered)
    assert request.request_dict["max_retries"] == max_retries
    # A retry (Task.retry keeps the custom headers) writes it again, never the task's 5.
    app.tasks["proto.add"].apply_async((1, 2), retries=1, headers={"max_retries": max_retries})
    retried = store(published[0])
    assert retried.max_retries == (1 if max_retries == 0 else max_retries)  # >= retry_count
    assert ADAPTER.to_message(retried, "celery")["headers"]["max_retries"] == max_retries


def test_max_retries_changed_after_celery_wrote_it_caps_celery(app: Celery,
                                                                published: list) -> None:
    app.tasks["proto.add"].delay(1, 2)
    written = store(published[0])
    assert written.max_retries == 5
    assert "max_retries" not in ADAPTER.to_message(written, "celery")["headers"]
    replayed = written.model_copy(update={"max_retries": 0})  # dlq replay --max-retries 0
    assert ADAPTER.to_message(replayed, "celery")["headers"]["max_retries"] == 0


def test_a_task_unknown_to_its_producer_retries_by_the_workers_max_retries(
        app: Celery, published: list) -> None:
    producer = Celery("producer", broker="memory://", set_as_current=True)  # no tasks
    try:
        producer.send_task("proto.unlimited")
        written = store(published[0])
    finally:
        app.set_current()
        producer.close()
    assert written.max_retries == 3  # the protocol's default: the producer cannot know
    # The worker's task (max_retries=None) decides, as in Celery.
    assert "max_retries" not in ADAPTER.to_message(written, "celery")["headers"]


def test_unlimited_retries_map_to_null(app: Celery, published: list) -> None:
    app.tasks["proto.unlimited"].delay()
    envelope, _ = assert_lossless(published[0])
    assert envelope.max_retries is None
    assert b'"max_retries":null' in envelope.to_json()


@pytest.mark.parametrize(("celery_priority", "priority"), [
    (0, 255), (1, 227), (3, 170), (4, 142), (5, 113), (8, 28), (9, 0), (None, 100),
    (42, 0), (-3, 255),
])
def test_priority_maps_to_0_255_most_urgent_highest(app: Celery, published: list,
                                                    celery_priority: int | None,
                                                    priority: int) -> None:
    app.tasks["proto.add"].apply_async((1, 2), priority=celery_priority)
    envelope, _ = assert_lossless(published[0])
    assert envelope.priority == priority
    assert envelope.ext["celery"].get("priority") == celery_priority  # None: left out


@pytest.mark.parametrize(("priority", "celery_priority"), [
    (255, 0), (200, 2), (170, 3), (101, 5), (100, None), (99, 6), (0, 9),
])
def test_envelope_priority_maps_back_to_celery(priority: int, celery_priority: int | None) -> None:
    assert to_celery_priority(priority) == celery_priority


def test_celery_priorities_survive_a_round_trip_through_envelope_priorities() -> None:
    for celery_priority in [None, *range(10)]:
        assert to_celery_priority(to_envelope_priority(celery_priority)) == celery_priority


def test_string_headers_follow_the_documented_rule(app: Celery, published: list) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    app.tasks["proto.add"].apply_async((1, 2), headers={
        "x-tenant": "acme", "traceparent": traceparent, "X-Count": 3, "custom": "kept in ext",
    })
    envelope, _ = assert_lossless(published[0])
    assert envelope.headers == {"x-tenant": "acme", "traceparent": traceparent}
    assert envelope.ext["celery"]["headers"]["X-Count"] == 3
    assert envelope.ext["celery"]["headers"]["custom"] == "kept in ext"


def test_payload_version_and_idempotency_key_headers(app: Celery, published: list) -> None:
    app.tasks["proto.v2"].apply_async(kwargs={"a": 1},
                                      headers={"payload_version": 2, "idempotency_key": "k-1"})
    envelope, _ = assert_lossless(published[0])
    assert (envelope.payload_version, envelope.idempotency_key) == (2, "k-1")


# ------------------------------------------------------------------- tracing


def test_trace_id_comes_from_the_trace_block(app: Celery, published: list) -> None:
    with trace("trace-0001") as trace_id:
        app.tasks["proto.add"].delay(1, 2)
    envelope, delivered = assert_lossless(published[0])
    assert envelope.trace_id == trace_id == "trace-0001"
    assert celery_request(app, delivered).request_dict["trace_id"] == "trace-0001"


def test_trace_id_is_generated_when_missing(app: Celery, published: list) -> None:
    app.tasks["proto.add"].delay(1, 2)
    message = published[0]
    del message["headers"]["trace_id"]
    envelope = store(message)
    assert ADAPTER.to_message(envelope, "celery")["headers"]["trace_id"] == envelope.trace_id


def test_log_filter_adds_the_trace_id() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "message", None, None)
    TraceIdFilter().filter(record)
    assert record.trace_id == "-"
    with trace("trace-0002"):
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "message", None, None)
        TraceIdFilter().filter(record)
    assert record.trace_id == "trace-0002"


# -------------------------------------------------------------------- canvas


def test_chain_link_and_link_error_survive(app: Celery, published: list) -> None:
    add = app.tasks["proto.add"]
    chain(add.s(1, 2), add.s(3), add.s(4)).apply_async()
    add.apply_async((1, 2), link=add.s(10), link_error=add.si(0, 0))
    chained, _ = assert_lossless(published[0])
    assert [sig["args"] for sig in chained.ext["celery"]["embed"]["chain"]] == [[4], [3]]
    linked, _ = assert_lossless(published[1])
    assert linked.ext["celery"]["embed"]["callbacks"][0]["args"] == [10]
    assert linked.ext["celery"]["embed"]["errbacks"][0]["immutable"] is True


def test_group_and_chord_survive(app: Celery, published: list) -> None:
    add = app.tasks["proto.add"]
    group(add.s(1, 1), add.s(2, 2)).apply_async()
    chord([add.s(3, 3), add.s(4, 4)], app.tasks["proto.collect"].s()).apply_async()
    envelopes = [assert_lossless(message)[0] for message in published]
    groups = [e.ext["celery"]["headers"]["group"] for e in envelopes]
    assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2]
    assert [e.ext["celery"]["headers"]["group_index"] for e in envelopes] == [0, 1, 0, 1]
    assert envelopes[3].ext["celery"]["embed"]["chord"]["task"] == "proto.collect"


def test_stamps_survive(app: Celery, published: list) -> None:
    signature = app.tasks["proto.add"].s(1, 2)
    signature.stamp(tenant="acme")
    signature.apply_async()
    envelope, delivered = assert_lossless(published[0])
    assert envelope.ext["celery"]["headers"]["stamps"] == {"tenant": "acme"}
    assert delivered["headers"]["stamped_headers"] == ["tenant"]


def test_what_delivery_writes_anyway_is_not_stored(app: Celery, published: list) -> None:
    """A plain call stores only the headers and properties that say something."""
    app.tasks["proto.add"].apply_async(kwargs={"x": 1, "y": 2})
    envelope, delivered = assert_lossless(published[0])
    celery = envelope.ext["celery"]
    assert set(celery) == {"headers", "properties", "max_retries"}
    assert set(celery["headers"]) == {"kwargsrepr", "origin", "ignore_result"}
    assert "correlation_id" not in celery["properties"]
    assert delivered["headers"]["root_id"] == delivered["properties"]["correlation_id"] == (
        envelope.task_id)


@pytest.mark.parametrize(("name", "value"), [
    ("replaced_task_nesting", False), ("replaced_task_nesting", 1), ("lang", "go"),
    ("timelimit", [None, 5]), ("stamps", {"k": "v"}), ("argsrepr", "(1,)"),
    ("root_id", "another-task"), ("shadow", "alias"),
])
def test_headers_that_say_something_are_stored(app: Celery, published: list, name: str,
                                               value: Any) -> None:
    app.tasks["proto.add"].apply_async((1, 2), headers={"x-pad": "1"})
    message = published[0]
    message["headers"][name] = value
    envelope, _ = assert_lossless(message)
    stored = envelope.ext["celery"]["headers"][name]
    assert stored == value and type(stored) is type(value)


def test_a_celery_envelope_stored_before_headers_were_left_out_delivers_the_same(
        app: Celery, published: list) -> None:
    """ext.celery written with every header (by earlier versions) is delivered as it was."""
    app.tasks["proto.add"].apply_async((1, 2), priority=None)
    message = published[0]
    envelope = store(message)
    full = json.loads(envelope.to_json())
    full["ext"]["celery"]["headers"] = {
        k: v for k, v in message["headers"].items()
        if k not in {"task", "id", "retries", "trace_id", "expires"}}
    full["ext"]["celery"].update(priority=None, embed={
        "callbacks": None, "errbacks": None, "chain": None, "chord": None})
    full["ext"]["celery"]["properties"]["correlation_id"] = envelope.task_id
    assert ADAPTER.to_message(Envelope.parse(full), "celery") == ADAPTER.to_message(
        envelope, "celery")


# ------------------------------------------------- Envelopes of other languages


def test_envelope_of_another_language_becomes_a_plain_celery_task(app: Celery) -> None:
    envelope = Envelope.new(
        task_type="proto.add", payload={"x": 1, "y": 2}, retry_count=2, priority=200,
        schedule_time="2030-01-01T00:00:00Z", timeout_ms=1500, trace_id="go-trace",
        headers={"traceparent": "00-abc-def-01", "task": "ignored", "tenant": "acme"},
    )
    delivered = ADAPTER.to_message(envelope, "celery")
    assert json.loads(delivered["body"]) == [
        [], {"x": 1, "y": 2}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    headers = delivered["headers"]
    assert (headers["task"], headers["id"], headers["root_id"]) == (
        "proto.add", envelope.task_id, envelope.task_id)
    assert (headers["retries"], headers["trace_id"], headers["timelimit"]) == (
        2, "go-trace", [1.5 + HARD_LIMIT_GRACE_S, 1.5])
    assert (headers["traceparent"], headers["tenant"]) == ("00-abc-def-01", "acme")
    assert "payload_version" not in headers
    assert delivered["properties"]["priority"] == 2
    assert delivered["properties"]["correlation_id"] == envelope.task_id
    request = celery_request(app, delivered)
    assert (request.args, request.kwargs) == ([], {"x": 1, "y": 2})
    assert request.eta == datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert request.time_limits == [1.5 + HARD_LIMIT_GRACE_S, 1.5]


def test_fields_changed_by_another_language_win_over_ext(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async((1, 2), priority=3, time_limit=10,
                                       eta=datetime(2030, 1, 1, tzinfo=timezone.utc))
    retried = store(published[0]).model_copy(update={
        "priority": 0, "timeout_ms": 2000, "retry_count": 1,
        "schedule_time": datetime(2031, 1, 1, tzinfo=timezone.utc)})
    delivered = ADAPTER.to_message(retried, "celery")
    assert delivered["properties"]["priority"] == 9
    assert delivered["headers"]["timelimit"] == [2 + HARD_LIMIT_GRACE_S, 2]
    assert delivered["headers"]["retries"] == 1
    assert delivered["headers"]["eta"] == "2031-01-01T00:00:00+00:00"


def test_unknown_task_type_is_undeliverable(app: Celery) -> None:
    with pytest.raises(Undeliverable) as raised:
        ADAPTER.to_message(Envelope.new(task_type="nobody.knows"), "celery")
    assert raised.value.failure_class == "unknown_task_type"
    assert "nobody.knows" in raised.value.reason


def test_unknown_task_rule_waits_for_a_finalized_worker_app(app: Celery) -> None:
    pending = Celery("pending", broker="memory://", set_as_current=False)
    try:
        serve_worker_app(sender=SimpleNamespace(app=pending))
        message = ADAPTER.to_message(Envelope.new(task_type="nobody.knows"), "celery")
        assert message["headers"]["task"] == "nobody.knows"
    finally:
        pending.close()


def test_processes_that_are_not_workers_deliver_every_task(app: Celery) -> None:
    set_worker_app(None)
    message = ADAPTER.to_message(Envelope.new(task_type="nobody.knows"), "celery")
    assert message["headers"]["task"] == "nobody.knows"


@pytest.mark.parametrize(("task_type", "version", "deliverable"), [
    ("proto.add", 1, True), ("proto.add", 2, False),
    ("proto.v2", 1, False), ("proto.v2", 3, True),
])
def test_payload_versions_option(app: Celery, task_type: str, version: int,
                                 deliverable: bool) -> None:
    envelope = Envelope.new(task_type=task_type, payload_version=version)
    if deliverable:
        headers = ADAPTER.to_message(envelope, "celery")["headers"]
        assert headers.get("payload_version", 1) == version
        return
    with pytest.raises(Undeliverable) as raised:
        ADAPTER.to_message(envelope, "celery")
    assert raised.value.failure_class == "unsupported_payload_version"


# ----------------------------------------------------------- refused messages


def test_pickled_task_is_refused_naming_the_serializer(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async((1, 2), serializer="pickle")
    message = published[0]
    with pytest.raises(UnsupportedMessage, match=r"'pickle'.*json"):
        ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)


@pytest.mark.parametrize(("content_type", "serializer"), [
    ("application/x-yaml", "yaml"), ("application/x-msgpack", "msgpack"),
])
def test_other_serializers_are_refused(app: Celery, published: list, content_type: str,
                                       serializer: str) -> None:
    app.tasks["proto.add"].delay(1, 2)
    message = {**published[0], "content-type": content_type}
    with pytest.raises(UnsupportedMessage, match=rf"'{serializer}'.*task_serializer = 'json'"):
        ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)


def test_compressed_task_is_refused(app: Celery, published: list) -> None:
    app.tasks["proto.add"].apply_async((1, 2), compression="gzip")
    message = published[0]
    with pytest.raises(UnsupportedMessage, match="compress"):
        ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)


def test_protocol_1_task_is_refused(published: list) -> None:
    app = make_app("proto_v1", task_protocol=1)
    try:
        app.tasks["proto.add"].delay(1, 2)
        message = published[0]
        with pytest.raises(UnsupportedMessage, match="protocol 1"):
            ADAPTER.to_envelope(message, body_of(message), DEFAULT_LIMITS)
    finally:
        app.close()


def test_other_messages_go_to_the_base_adapter() -> None:
    plain = {"content-type": "application/json", "headers": {}, "properties": {}}
    assert ADAPTER.to_envelope(plain, '{"type": "worker-heartbeat"}', DEFAULT_LIMITS) is None
    envelope = Envelope.new(task_type="proto.add")
    raw = {"content-type": ENVELOPE_CONTENT_TYPE, "headers": {}, "properties": {}}
    assert ADAPTER.to_envelope(raw, envelope.to_json(), DEFAULT_LIMITS) == envelope


# ---------------------------------------------------------------- enabling


def test_importing_celery_ext_registers_the_transport() -> None:
    assert TRANSPORT_ALIASES["envelope"] == TRANSPORT_ALIASES["envelopes"] == \
        "celery_ext.transport:Transport"
    assert Transport.default_adapter is CeleryAdapter


def test_install_is_idempotent() -> None:
    from celery import signals

    before = len(signals.before_task_publish.receivers)
    celery_ext.install()
    celery_ext.install()
    assert len(signals.before_task_publish.receivers) == before


def test_invalid_envelope_raised_by_a_task_reads_back_from_the_result_backend() -> None:
    """The backend stores the exception's type and message, and rebuilds it from them."""
    error = InvalidEnvelope([Violation("payload", "max_depth", "nested deeper than 5 levels")])
    backend = BaseBackend(app=Celery(set_as_current=False))
    rebuilt = backend.exception_to_python(backend.prepare_exception(error, "json"))
    assert type(rebuilt) is InvalidEnvelope
    assert str(rebuilt) == str(error)
