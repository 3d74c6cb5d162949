"""Real ``celery worker`` processes on ``envelope://`` (apps/envelope_app.py)."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery, chain, chord, group
from celery.result import AsyncResult
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import CeleryWorker

from celery_ext import trace
from kombu_envelope.codec import decode_entry
from kombu_envelope.errors import InvalidEnvelope, UnsupportedMessage
from kombu_envelope.keys import Bucket, KeySpace

APP = "apps.envelope_app"
RESULT_TIMEOUT = 20


def worker_env(redis_url: str, prefix: str, scheme: str = "envelope") -> dict[str, str]:
    broker = envelope_url(redis_url) if scheme == "envelope" else redis_url
    return {"TEST_BROKER_URL": broker, "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": "5000"}


def client_app(redis_url: str, prefix: str, scheme: str = "envelope") -> Celery:
    """The publishing side: the same app module as the workers."""
    env = worker_env(redis_url, prefix, scheme)
    return create_app(env["TEST_BROKER_URL"], redis_url, prefix, 5000)


def xadd_envelope(client: redis.Redis, prefix: str, envelope: dict[str, Any]) -> None:
    """Add an Envelope as another language would: raw JSON in a stream entry."""
    envelope = {"trace_id": uuid.uuid4().hex, "created_at": "2025-09-11T12:45:00+08:00",
                **envelope}
    fields = {"v": "1", "enc": "json", "body": json.dumps(envelope)}
    client.xadd(KeySpace(prefix).queue("celery").stream(Bucket.NORMAL), fields)


def dead_by_task(client: redis.Redis, prefix: str, task_id: str) -> dict[str, bytes] | None:
    for fields in dead_letters(client, prefix, "celery"):
        if fields.get("task_id") == task_id.encode():
            return fields
    return None


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    """A solo worker with task events (-E), shared by the tests of this module."""
    with CeleryWorker(APP, pool="solo", env=worker_env(redis_url, prefix),
                      extra_args=["-E"]) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = client_app(redis_url, prefix)
    yield app
    app.close()



# ----------------------------------------------------------------- running


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_task_result_and_trace_id_in_the_log(redis_url: str, key_prefix: str, pool: str) -> None:
    app = client_app(redis_url, key_prefix)
    try:
        with CeleryWorker(APP, pool=pool, concurrency=2,
                          env=worker_env(redis_url, key_prefix)) as worker:
            assert app.tasks["envelope_app.add"].delay(2, 3).get(timeout=RESULT_TIMEOUT) == 5
            with trace(f"trace-{pool}-{uuid.uuid4().hex[:8]}") as trace_id:
                result = app.tasks["envelope_app.log_trace"].delay("hello")
            assert result.get(timeout=RESULT_TIMEOUT) == trace_id
            # Celery's lines for the task, and the task's own line, all show its trace id.
            lines = [
                rf"\[trace_id={trace_id}\] Task envelope_app.log_trace\[{result.id}\] received",
                rf"log_trace\[{result.id}\] \[trace_id={trace_id}\] logging hello",
                rf"\[trace_id={trace_id}\] Task envelope_app.log_trace\[{result.id}\] succeeded",
            ]
            wait_for(lambda: all(re.search(line, worker.log_text()) for line in lines),
                     message=worker.log_tail)
    finally:
        app.close()


@pytest.mark.parametrize("scheme", ["redis", "envelope"])
def test_an_unchanged_app_runs_on_both_urls(redis_url: str, key_prefix: str, scheme: str,
                                            redis_client: redis.Redis) -> None:
    app = client_app(redis_url, key_prefix, scheme)
    try:
        with CeleryWorker(APP, env=worker_env(redis_url, key_prefix, scheme)) as started:
            result = chain(app.tasks["envelope_app.add"].s(1, 2),
                           app.tasks["envelope_app.add"].s(3)).apply_async()
            assert result.get(timeout=RESULT_TIMEOUT) == 6
            assert ("envelope worker ready" in started.log_text()) == (scheme == "envelope")
    finally:
        app.close()
    streams = redis_client.keys(f"{KeySpace(key_prefix).queue('celery').base}:*")
    assert bool(streams) == (scheme == "envelope")


def test_a_ready_worker_says_what_it_serves(redis_url: str, key_prefix: str) -> None:
    with CeleryWorker(APP, env=worker_env(redis_url, key_prefix),
                      extra_args=["-Q", "orders,celery"]) as started:
        line = re.search(r"envelope worker ready: queues (.*); task types (.*)",
                         started.log_text())
        assert line is not None, started.log_tail()
    assert line.group(1) == "celery, orders"
    served = line.group(2)
    assert "envelope_app.add (payload versions 1)" in served
    assert "envelope_app.v2_only (payload versions 2)" in served
    assert "celery." not in served


def test_positional_args_are_stored_as_named_fields(app: Celery, worker: CeleryWorker,
                                                    redis_client: redis.Redis, prefix: str) -> None:
    add, collect = app.tasks["envelope_app.add"], app.tasks["envelope_app.collect"]
    add.apply_async((2, 3), queue="parked")  # a queue no worker reads
    collect.apply_async((1, 2, 3), {"k": 4}, queue="parked")
    stream = KeySpace(prefix).queue("parked").stream(Bucket.NORMAL)
    stored = [decode_entry(fields) for _, fields in redis_client.xrange(stream)]
    assert [e.payload for e in stored] == [{"x": 2, "y": 3}, {"first": 1, "k": 4}]
    assert stored[1].ext["celery"]["args"] == [2, 3]
    assert add.delay(2, 3).get(timeout=RESULT_TIMEOUT) == 5
    assert collect.delay(1, 2, 3, k=4).get(timeout=RESULT_TIMEOUT) == [1, [2, 3], {"k": 4}]


def test_refused_tasks_never_reach_redis(app: Celery, redis_client: redis.Redis,
                                        prefix: str) -> None:
    add = app.tasks["envelope_app.add"]
    with pytest.raises(InvalidEnvelope) as naive:
        add.apply_async((1, 2), eta=datetime(2030, 1, 1), queue="refused")
    assert naive.value.fields == ["schedule_time"]
    with pytest.raises(UnsupportedMessage, match="pickle"):
        add.apply_async((1, 2), serializer="pickle", queue="refused")
    keys = KeySpace(prefix).queue("refused")
    assert sum(redis_client.xlen(stream) for stream in keys.all_streams) == 0
    assert redis_client.zcard(keys.delayed) == 0


def test_envelope_from_another_language_runs(app: Celery, worker: CeleryWorker,
                                             redis_client: redis.Redis, prefix: str) -> None:
    task_id = str(uuid.uuid4())
    xadd_envelope(redis_client, prefix, {
        "task_id": task_id, "task_type": "order.close_timeout", "payload": {"order_id": 42},
        "retry_count": 1, "trace_id": "go-7f3a", "created_at": "2025-09-11T12:45:00+08:00",
    })
    result = AsyncResult(task_id, app=app).get(timeout=RESULT_TIMEOUT)
    assert result == {"closed": 42, "retries": 1, "trace_id": "go-7f3a"}


def test_undeliverable_tasks_are_dead_lettered(app: Celery, worker: CeleryWorker,
                                               redis_client: redis.Redis, prefix: str) -> None:
    unknown = str(uuid.uuid4())
    xadd_envelope(redis_client, prefix, {"task_id": unknown, "task_type": "nobody.knows"})
    old_version = app.tasks["envelope_app.v2_only"].delay(a=1)
    new_version = str(uuid.uuid4())
    xadd_envelope(redis_client, prefix, {"task_id": new_version,
                                         "task_type": "envelope_app.v2_only",
                                         "payload_version": 2, "payload": {"a": 2}})
    assert AsyncResult(new_version, app=app).get(timeout=RESULT_TIMEOUT) == {"a": 2}
    for task_id, failure_class in [(unknown, b"unknown_task_type"),
                                   (old_version.id, b"unsupported_payload_version")]:
        dead = wait_for(lambda task_id=task_id: dead_by_task(redis_client, prefix, task_id),
                        message=worker.log_tail)
        assert dead["failure_class"] == failure_class
    assert app.tasks["envelope_app.add"].delay(1, 1).get(timeout=RESULT_TIMEOUT) == 2


def test_malformed_entries_are_dead_lettered_with_their_bytes(
        app: Celery, worker: CeleryWorker, redis_client: redis.Redis, prefix: str) -> None:
    stream = KeySpace(prefix).queue("celery").stream(Bucket.NORMAL)
    malformed = [
        {"v": b"1", "enc": b"json", "body": b"{not json"},
        {"v": b"1", "enc": b"json"},
        {"v": b"7", "enc": b"json", "body": b'{"task_type": "envelope_app.add"}'},
        {"v": b"1", "enc": b"json+gzip", "body": b"\x1f\x8bnot really gzip"},
        {"v": b"1", "enc": b"json", "body": b'{"payload": {}}'},
    ]
    for fields in malformed:
        redis_client.xadd(stream, {**fields, "probe": uuid.uuid4().hex.encode()})
    assert app.tasks["envelope_app.add"].delay(2, 2).get(timeout=RESULT_TIMEOUT) == 4

    def raw_of_dead() -> list[dict[str, bytes]]:
        return [{k[4:]: v for k, v in fields.items() if k.startswith("raw.")}
                for fields in dead_letters(redis_client, prefix, "celery")
                if fields["failure_class"] == b"malformed_entry"]

    wait_for(lambda: len(raw_of_dead()) >= len(malformed), message=worker.log_tail)
    kept = [{k: v for k, v in raw.items() if k != "probe"} for raw in raw_of_dead()]
    for fields in malformed:
        assert fields in kept
    assert worker.is_alive()


def test_trace_id_follows_a_chain(app: Celery, worker: CeleryWorker) -> None:
    add, log_trace = app.tasks["envelope_app.add"], app.tasks["envelope_app.log_trace"]
    with trace() as trace_id:
        result = chain(add.s(1, 2), log_trace.s()).apply_async()
    assert result.get(timeout=RESULT_TIMEOUT) == trace_id
    wait_for(lambda: f"[trace_id={trace_id}] logging 3" in worker.log_text(),
             message=worker.log_tail)


def test_canvas_with_the_redis_result_backend(app: Celery, worker: CeleryWorker) -> None:
    add, tsum = app.tasks["envelope_app.add"], app.tasks["envelope_app.tsum"]
    assert chain(add.s(1, 2), add.s(3), add.s(4)).apply_async().get(timeout=RESULT_TIMEOUT) == 10
    assert group(add.s(i, i) for i in range(4)).apply_async().get(
        timeout=RESULT_TIMEOUT) == [0, 2, 4, 6]
    assert chord((add.s(i, i) for i in range(4)), tsum.s()).apply_async().get(
        timeout=RESULT_TIMEOUT) == 12


def test_retry_without_countdown(app: Celery, worker: CeleryWorker) -> None:
    key = uuid.uuid4().hex
    assert app.tasks["envelope_app.flaky"].delay(key, 2).get(timeout=RESULT_TIMEOUT) == 3


def test_retry_with_countdown(app: Celery, worker: CeleryWorker) -> None:
    # The delayed retry waits in the delayed set until the worker's promoter moves it.
    key = uuid.uuid4().hex
    result = app.tasks["envelope_app.flaky"].delay(key, 1, countdown=0.5)
    assert result.get(timeout=RESULT_TIMEOUT) == 2


def test_task_rejected_with_requeue_is_delivered_again_as_redelivered(
        app: Celery, worker: CeleryWorker) -> None:
    result = app.tasks["envelope_app.reject_once"].delay()
    assert result.get(timeout=RESULT_TIMEOUT) == "redelivered"


def test_task_events_reach_a_receiver(app: Celery, worker: CeleryWorker) -> None:
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": seen.append})
        receiver.queue.bind(connection.default_channel).declare()
        consuming = threading.Thread(target=receiver.capture,
                                     kwargs={"limit": None, "timeout": None, "wakeup": False})
        consuming.start()
        try:
            result = app.tasks["envelope_app.add"].delay(5, 5)
            assert result.get(timeout=RESULT_TIMEOUT) == 10
            wait_for(lambda: {"task-received", "task-started", "task-succeeded"} <= {
                event["type"] for event in seen if event.get("uuid") == result.id},
                message=lambda: f"events seen: {[e['type'] for e in seen]}")
        finally:
            receiver.should_stop = True
            consuming.join(10)
    assert not consuming.is_alive()


def test_inspect_ping_and_remote_shutdown(redis_url: str, key_prefix: str) -> None:
    app = client_app(redis_url, key_prefix)
    try:
        with CeleryWorker(APP, env=worker_env(redis_url, key_prefix)) as worker:
            replies = wait_for(
                lambda: app.control.inspect(destination=[worker.hostname], timeout=1).ping(),
                message=worker.log_tail)
            assert replies == {worker.hostname: {"ok": "pong"}}
            app.control.shutdown(destination=[worker.hostname])
            wait_for(lambda: not worker.is_alive(), timeout=20, message=worker.log_tail)
            assert worker.returncode == 0
    finally:
        app.close()
