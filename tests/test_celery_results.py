"""Results for Celery callers (docs/protocol.md, section 12).

A Celery producer names where the result goes in ``ext.celery.result``; a
result written there by hand, exactly as section 12 says, is what a Celery
caller's ``AsyncResult.get()`` reads.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TaskRevokedError
from kombu.transport import memory as memory_transport

from celery_ext.protocol import CeleryAdapter
from celery_ext.results import result_ext
from kombu_envelope.envelope import DEFAULT_LIMITS, Envelope

ADAPTER = CeleryAdapter()


def result_app(backend: str, **conf: Any) -> Celery:
    app = Celery("results", broker="memory://", backend=backend, set_as_current=True)
    app.conf.update(conf)

    @app.task(name="results.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="results.quiet", shared=False, ignore_result=True)
    def quiet() -> None:
        return None

    app.finalize()
    return app


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Messages the memory transport was asked to store, in order."""
    messages: list[dict[str, Any]] = []

    def capture(channel: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        messages.append(message)

    monkeypatch.setattr(memory_transport.Channel, "_put", capture)
    return messages


def envelope_of(message: dict[str, Any]) -> Envelope:
    envelope = ADAPTER.to_envelope(message, base64.b64decode(message["body"]), DEFAULT_LIMITS)
    assert envelope is not None
    return Envelope.parse(envelope.to_json())


@pytest.fixture
def redis_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = result_app(redis_url, result_expires=600,
                     result_backend_transport_options={"global_keyprefix": f"{key_prefix}:"})
    yield app
    app.close()


def test_a_task_that_wants_a_result_names_its_backend_key(
    redis_app: Celery, published: list, key_prefix: str,
) -> None:
    sent = redis_app.tasks["results.add"].delay(1, 2)
    result = envelope_of(published[0]).ext["celery"]["result"]
    assert result == {"key": f"{key_prefix}:celery-task-meta-{sent.id}", "expires_s": 600}
    assert result["key"].encode() == redis_app.backend.get_key_for_task(sent.id)


def test_no_result_field_when_the_result_is_ignored(redis_app: Celery, published: list) -> None:
    redis_app.tasks["results.quiet"].delay()  # the task option
    redis_app.tasks["results.add"].apply_async((1, 2), ignore_result=True)  # the call's
    redis_app.conf.task_ignore_result = True
    redis_app.send_task("results.add", (1, 2), ignore_result=False)
    assert [("result" in envelope_of(m).ext["celery"]) for m in published] == [
        False, False, True]


def test_results_without_expiry_say_null(published: list, redis_url: str) -> None:
    app = result_app(redis_url, result_expires=None)
    try:
        sent = app.send_task("results.add", (1, 2))
        assert envelope_of(published[0]).ext["celery"]["result"] == {
            "key": f"celery-task-meta-{sent.id}", "expires_s": None}
    finally:
        app.close()


@pytest.mark.parametrize("backend", ["sentinel://127.0.0.1:1/0",
                                     "rediss://127.0.0.1:1/0?ssl_cert_reqs=required"])
def test_every_redis_backend_gets_the_field(backend: str) -> None:
    app = result_app(backend, result_expires=60)
    try:
        assert result_ext(app, "t-1", {"ignore_result": False}) == {
            "key": "celery-task-meta-t-1", "expires_s": 60}
    finally:
        app.close()


@pytest.mark.parametrize("backend", ["cache+memory://", "rpc://", None])
def test_no_result_field_for_other_backends(published: list, backend: str | None) -> None:
    app = result_app(backend) if backend else result_app("disabled://")
    try:
        app.send_task("results.add", (1, 2))
        assert "result" not in envelope_of(published[0]).ext["celery"]
    finally:
        app.close()


# ------------------------------------------------- results written by other languages


def write_result(client: redis.Redis, key: str, task_id: str, status: str, result: Any,
                 traceback: str | None = None) -> None:
    """What section 12 says a worker of any language writes."""
    meta = json.dumps({
        "status": status, "result": result, "traceback": traceback, "children": [],
        "date_done": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00"),
        "task_id": task_id,
    }, separators=(",", ":"))
    pipe = client.pipeline(transaction=True)
    pipe.set(key, meta, ex=600)
    pipe.publish(key, meta)
    pipe.execute()


def sent_result_key(app: Celery, published: list) -> tuple[Any, str]:
    sent = app.send_task("results.add", (1, 2))
    return sent, envelope_of(published[-1]).ext["celery"]["result"]["key"]


def test_a_success_written_by_hand_is_the_value(
    redis_app: Celery, published: list, redis_client: redis.Redis,
) -> None:
    sent, key = sent_result_key(redis_app, published)
    write_result(redis_client, key, sent.id, "SUCCESS", {"closed": 7, "items": [1, 2]})
    assert sent.get(timeout=10) == {"closed": 7, "items": [1, 2]}
    assert sent.state == "SUCCESS"


def test_a_failure_written_by_hand_raises_that_type_and_message(
    redis_app: Celery, published: list, redis_client: redis.Redis,
) -> None:
    sent, key = sent_result_key(redis_app, published)
    write_result(redis_client, key, sent.id, "FAILURE",
                 {"exc_type": "PaymentDeclined", "exc_message": ["card expired"],
                  "exc_module": None}, traceback="Traceback: in charge()")
    with pytest.raises(Exception) as raised:
        sent.get(timeout=10)
    assert type(raised.value).__name__ == "PaymentDeclined"
    assert str(raised.value) == "card expired"
    assert sent.state == "FAILURE"
    assert sent.traceback == "Traceback: in charge()"


@pytest.mark.parametrize("reason", ["revoked", "expired"])
def test_a_revoked_result_written_by_hand_raises_task_revoked_error(
    redis_app: Celery, published: list, redis_client: redis.Redis, reason: str,
) -> None:
    sent, key = sent_result_key(redis_app, published)
    write_result(redis_client, key, sent.id, "REVOKED",
                 {"exc_type": "TaskRevokedError", "exc_message": [reason],
                  "exc_module": "celery.exceptions"})
    with pytest.raises(TaskRevokedError, match=reason):
        sent.get(timeout=10)
    assert sent.state == "REVOKED"
