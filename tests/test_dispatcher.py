"""The dispatcher against a real Redis and a real uvicorn process: every endpoint that
does not need task records, worker announcements or payload schemas, and every error
path (tests/test_dispatcher_records.py has the others)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import wait_for

from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.dispatcher.server import OPENAPI_PATH, render_openapi
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket
from kombu_envelope.store.dead_letters import dead_letter_envelope
from kombu_envelope.testing.dispatcher import DispatcherProcess
from kombu_envelope.testing.redis_server import _free_port

READ, WRITE, OPERATOR = ("r-" + "a" * 30, "w-" + "b" * 30, "o-" + "c" * 30)
TOKENS = [{"name": "reader", "scope": "read", "token": READ},
          {"name": "writer", "scope": "write", "token": WRITE},
          {"name": "ops", "scope": "operator", "token": OPERATOR}]
ROOT = Path(__file__).resolve().parent.parent
PREFIX = f"t-disp-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, TOKENS, {"key_prefix": PREFIX},
                           extra_args=["--max-body-bytes", "65536", "--batch-max", "5"]) as proc:
        yield proc


@pytest.fixture
def api(server: DispatcherProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10,
                      headers={"Authorization": f"Bearer {OPERATOR}"}) as client:
        yield client


@pytest.fixture
def store(redis_url: str) -> Iterator[tuple[redis.Redis, Settings]]:
    client = redis.Redis.from_url(redis_url)
    yield client, Settings(key_prefix=PREFIX)
    client.close()


def _queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


def test_openapi_checked_in_equals_what_the_server_serves(api: httpx.Client) -> None:
    served = api.get("/openapi.json").json()
    assert json.loads(OPENAPI_PATH.read_text(encoding="utf-8")) == served, (
        "regenerate with: python -m kombu_envelope.dispatcher --write-openapi")
    assert OPENAPI_PATH.read_text(encoding="utf-8") == render_openapi()


def test_healthz_needs_no_token_and_every_answer_has_security_headers(
        server: DispatcherProcess) -> None:
    answer = httpx.get(server.url + "/healthz")
    assert answer.status_code == 200 and answer.json() == {"status": "ok", "redis": "ok"}
    missing = httpx.get(server.url + "/nowhere")
    for reply in (answer, missing):
        assert reply.headers["x-content-type-options"] == "nosniff"
        assert reply.headers["x-frame-options"] == "DENY"
        assert reply.headers["cache-control"] == "no-store"
        assert "default-src 'none'" in reply.headers["content-security-policy"]
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


@pytest.mark.parametrize(("headers", "status", "error"), [
    ({}, 401, "unauthorized"),
    ({"Authorization": "Bearer wrong-token-" + "x" * 20}, 401, "unauthorized"),
    ({"Authorization": "Basic " + "y" * 20}, 401, "unauthorized"),
    ({"Authorization": f"Bearer {READ}"}, 403, "forbidden"),
])
def test_missing_wrong_and_under_scoped_tokens(server: DispatcherProcess, headers: dict[str, str],
                                               status: int, error: str) -> None:
    answer = httpx.post(server.url + "/tasks/some-task/cancel", headers=headers)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"] == error
    secret = headers.get("Authorization", "").partition(" ")[2]
    assert not secret or secret not in answer.text  # errors never echo a token
    if status == 401:
        assert answer.headers["www-authenticate"].startswith("Bearer")


def test_write_token_cannot_replay_or_purge(server: DispatcherProcess) -> None:
    auth = {"Authorization": f"Bearer {WRITE}"}
    replay = httpx.post(server.url + "/dead-letters/q/1-0/replay", headers=auth)
    purge = httpx.delete(server.url + "/dead-letters/q", headers=auth)
    assert (replay.status_code, purge.status_code) == (403, 403)
    assert "needs scope operator" in replay.json()["message"]
    reader = httpx.get(server.url + "/delayed", headers={"Authorization": f"Bearer {READ}"})
    assert reader.status_code == 200


@pytest.mark.parametrize(("body", "field", "rule"), [
    (b'{"task_type": "a.b",', "envelope", "json"),
    (b'{"task_type": "a.b", "payload": {"x": NaN}}', "envelope", "json"),
    (b'["not", "an", "object"]', "envelope", "type"),
    (b'{"task_type": "a.b", "schedule_time": "2030-01-01T10:00:00"}', "schedule_time",
     "timezone_required"),
    (b'{"task_type": "a.b", "schedule_time": 1893456000}', "schedule_time", "type"),
    (b'{"task_type": "a.b", "created_at": 1893456000000}', "created_at", "type"),
    (b'{"task_type": "not a type"}', "task_type", "pattern"),
    (b'{"task_type": "a.b", "colour": "red"}', "colour", "unknown_field"),
    (b'{"payload": {}}', "task_type", "required"),
    (b'{"task_type": "a.b", "priority": 300}', "priority", "range"),
    (b'{"task_type": "a.b", "schedule_time": "2999-01-01T00:00:00Z"}', "schedule_time",
     "max_delay"),
    (b'{"task_type": "a.b", "limits": 1}', "limits", "unknown_field"),
])
def test_post_refuses_what_breaks_a_rule(api: httpx.Client, body: bytes, field: str,
                                         rule: str) -> None:
    answer = api.post("/tasks", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    violations = answer.json()["violations"]
    assert {"field": field, "rule": rule} in [
        {"field": v["field"], "rule": v["rule"]} for v in violations], violations


def test_oversize_body_is_413_and_batch_over_its_max_is_422(api: httpx.Client) -> None:
    big = json.dumps({"task_type": "a.b", "payload": {"blob": "x" * 70_000}}).encode()
    answer = api.post("/tasks", content=big, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and answer.json()["error"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it is read
        yield big[:40_000]
        yield big[40_000:]

    streamed = api.post("/tasks", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    batch = api.post("/tasks:batch", json={"tasks": [{"task_type": "a.b"}] * 6})
    assert batch.status_code == 422
    assert batch.json()["violations"][0]["field"] == "tasks"


def test_cancel_removes_a_delayed_task_then_marks(api: httpx.Client,
                                                  store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    due = datetime.now(timezone.utc) + timedelta(hours=1)
    envelope = Envelope.new(task_type="report.build", schedule_time=due)
    Publisher(client, settings).publish(queue, envelope)
    first = api.post(f"/tasks/{envelope.task_id}/cancel")
    assert first.json() == {"task_id": envelope.task_id, "outcome": "removed", "queue": queue}
    again = api.post(f"/tasks/{envelope.task_id}/cancel", params={"queue": queue})
    assert again.json()["outcome"] == "already"
    fresh = api.post("/tasks/never-seen-1/cancel").json()
    assert fresh["outcome"] == "marked"
    assert client.zscore(settings.keys.cancelled, "never-seen-1") is not None


def test_delayed_list_show_and_cancel(api: httpx.Client,
                                      store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    now = datetime.now(timezone.utc)
    envelopes = [Envelope.new(task_type="t.a" if i % 2 else "t.b",
                              schedule_time=now + timedelta(minutes=10 * (i + 1)))
                 for i in range(4)]
    Publisher(client, settings).publish_many([(queue, e) for e in envelopes])
    assert api.get("/delayed").json()["queues"][queue] == 4
    listed = api.get(f"/delayed/{queue}").json()
    assert [t["task_id"] for t in listed] == [e.task_id for e in envelopes]
    before = (now + timedelta(minutes=25)).isoformat()
    assert len(api.get(f"/delayed/{queue}", params={"due_before": before}).json()) == 2
    after = (now + timedelta(minutes=15)).isoformat()
    typed = api.get(f"/delayed/{queue}", params={"due_after": after, "task_type": "t.a"}).json()
    assert [t["task_id"] for t in typed] == [envelopes[1].task_id, envelopes[3].task_id]
    naive = api.get(f"/delayed/{queue}", params={"due_before": "2030-01-01T00:00:00"})
    assert naive.status_code == 422 and naive.json()["violations"][0] == {
        "field": "due_before", "rule": "timezone_required",
        "message": naive.json()["violations"][0]["message"]}
    shown = api.get(f"/delayed/{queue}/{envelopes[0].task_id}").json()
    assert shown["envelope"]["task_type"] == "t.b" and shown["due"].endswith("Z")
    cancelled = api.post(f"/delayed/{queue}/{envelopes[0].task_id}/cancel").json()
    assert cancelled["outcome"] == "removed"
    assert api.get(f"/delayed/{queue}/{envelopes[0].task_id}").status_code == 404
    assert api.get("/delayed/bad{queue}").status_code == 422


def test_periodic_entries_and_next_run(api: httpx.Client,
                                       store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    client.sadd(settings.keys.periodic_queues, queue)
    client.hset(settings.keys.queue(queue).periodic, mapping={
        "nightly": 1_900_000_000_000, "fingerprint:nightly": "abc"})
    entries = [e for e in api.get("/periodic").json() if e["queue"] == queue]
    assert entries == [{"queue": queue, "name": "nightly", "next_run": "2030-03-17T17:46:40Z",
                        "fingerprint": "abc"}]
    assert api.get(f"/periodic/{queue}/nightly").json()["next_run"] == "2030-03-17T17:46:40Z"
    assert api.get(f"/periodic/{queue}/fingerprint:nightly").status_code == 404


def test_dead_letters_list_show_stats_replay_and_purge(
        api: httpx.Client, store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    ids = []
    for number, (task_type, failure) in enumerate([
            ("bill.charge", FailureClass.TASK_ERROR), ("bill.charge", FailureClass.TIMEOUT),
            ("bill.refund", FailureClass.TASK_ERROR)]):
        envelope = Envelope.new(task_type=task_type, payload={"n": number})
        ids.append(dead_letter_envelope(
            client, settings, queue=queue, envelope=envelope, consumer="c1",
            failure=Failure(failure, "boom", task_id=envelope.task_id, task_type=task_type)))
    listed = api.get("/dead-letters", params={"queue": queue}).json()
    assert [e["id"] for e in listed] == ids
    charged = api.get("/dead-letters", params={"queue": queue, "task_type": "bill.charge",
                                               "failure_class": "timeout"}).json()
    assert [e["id"] for e in charged] == [ids[1]]
    shown = api.get(f"/dead-letters/{queue}/{ids[0]}").json()
    assert shown["failure_class"] == "task_error" and shown["envelope"]["payload"] == {"n": 0}
    stats = api.get("/dead-letters/stats", params={"queue": queue}).json()
    assert {(s["task_type"], s["failure_class"], s["count"]) for s in stats} == {
        ("bill.charge", "task_error", 1), ("bill.charge", "timeout", 1),
        ("bill.refund", "task_error", 1)}
    bad = api.post(f"/dead-letters/{queue}/{ids[0]}/replay", json={"payload_version": 0})
    assert bad.status_code == 422 and bad.json()["violations"][0]["field"] == "payload_version"
    deep = api.post(f"/dead-letters/{queue}/{ids[0]}/replay",
                    json={"payload": {"a": {"b": {"c": {"d": {"e": {}}}}}}})
    assert deep.status_code == 422 and deep.json()["violations"][0]["rule"] == "max_depth"
    replayed = api.post(f"/dead-letters/{queue}/{ids[0]}/replay",
                        json={"merge_patch": {"n": 10}})
    assert replayed.status_code == 200, replayed.text
    new_id = replayed.json()["new_id"]
    entry = client.xrange(settings.keys.queue(queue).stream(Bucket.NORMAL), new_id, new_id)
    assert json.loads(entry[0][1][b"body"])["payload"] == {"n": 10}
    assert api.post(f"/dead-letters/{queue}/{ids[0]}/replay").status_code == 404
    assert api.get(f"/dead-letters/{queue}/not-an-id").status_code == 422
    purged = api.delete(f"/dead-letters/{queue}", params={"task_type": "bill.refund"}).json()
    assert purged == {"queue": queue, "purged": 1}
    assert api.delete(f"/dead-letters/{queue}").json()["purged"] == 1


def test_rate_limit_per_token(redis_url: str) -> None:
    with DispatcherProcess(redis_url, TOKENS, {"key_prefix": PREFIX},
                           extra_args=["--rate", "0.001", "--burst", "3"]) as proc:
        answers = [httpx.get(proc.url + "/delayed", headers={"Authorization": f"Bearer {READ}"})
                   for _ in range(5)]
        other = httpx.get(proc.url + "/delayed", headers={"Authorization": f"Bearer {WRITE}"})
        guesses = [httpx.get(proc.url + "/delayed",
                             headers={"Authorization": f"Bearer guess-{n:020d}"}).status_code
                   for n in range(5)]
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    assert [a.status_code for a in answers[3:]] == [429, 429]
    assert int(answers[4].headers["retry-after"]) >= 1
    assert other.status_code == 200
    assert guesses == [401, 401, 401, 429, 429]  # unknown tokens are limited per address


def test_whoami_answers_the_tokens_name_and_scope(server: DispatcherProcess) -> None:
    for secret, name, scope in ((READ, "reader", "read"), (WRITE, "writer", "write"),
                                (OPERATOR, "ops", "operator")):
        answer = httpx.get(server.url + "/whoami", headers={"Authorization": f"Bearer {secret}"})
        assert answer.json() == {"name": name, "scope": scope, "authenticated": True}
    assert httpx.get(server.url + "/whoami").status_code == 401


def test_without_tokens_only_loopback_and_it_says_so(redis_url: str) -> None:
    with DispatcherProcess(redis_url, options={"key_prefix": PREFIX}) as proc:
        assert httpx.get(proc.url + "/delayed").status_code == 200
        assert httpx.get(proc.url + "/whoami").json() == {
            "name": "127.0.0.1", "scope": "operator", "authenticated": False}
        assert "no token configured" in proc.log()
    from kombu_envelope.dispatcher.config import DispatcherConfig

    with pytest.raises(ValueError, match="loopback"):
        DispatcherConfig(host="0.0.0.0")


def test_celery_command_serves_the_apps_broker(redis_url: str, tmp_path: Path,
                                               store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    due = datetime.now(timezone.utc) + timedelta(hours=1)
    Publisher(client, settings).publish(queue, Envelope.new(task_type="x.y", schedule_time=due))
    port = _free_port()
    env = {**os.environ, "TEST_BROKER_URL": redis_url.replace("redis://", "envelope://"),
           "TEST_KEY_PREFIX": PREFIX, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"}
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "apps.envelope_app",
                             "envelope", "dispatcher", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        def counts() -> Any:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/delayed").json()["queues"]
            except httpx.HTTPError:
                return None

        assert wait_for(counts, timeout=30, interval=0.1,
                        message=lambda: (tmp_path / "log").read_text())[queue] == 1
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    assert "no token configured" in (tmp_path / "log").read_text()


def test_batch_answers_bad_json_and_non_objects(api: httpx.Client) -> None:
    broken = api.post("/tasks:batch", content=b'{"tasks": [',
                      headers={"Content-Type": "application/json"})
    assert broken.status_code == 422
    assert broken.json()["violations"][0] == {
        "field": "body", "rule": "json", "message": "JSON decode error"}
    items = api.post("/tasks:batch", json={"tasks": [1, "x"]}).json()["items"]
    assert [(i["index"], i["status"], i["problem"]["violations"][0]["rule"]) for i in items] == [
        (0, 422, "type"), (1, 422, "type")]
    replay = api.post("/dead-letters/q/1-0/replay", content=b"\n\xff",
                      headers={"Content-Type": "application/json"})
    assert replay.status_code == 422 and replay.json()["violations"][0]["rule"] == "json"


def test_a_post_that_asks_for_an_h2c_upgrade_keeps_its_body(server: DispatcherProcess) -> None:
    """java.net.http's default client asks every HTTP/1.1 request to upgrade to h2c."""
    body = b'{"merge_patch": 1}'
    request = (f"POST /dead-letters/q/1-0/replay HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Authorization: Bearer {OPERATOR}\r\nConnection: Upgrade, HTTP2-Settings\r\n"
               f"Upgrade: h2c\r\nHTTP2-Settings: AAEAAEAAAAIAAAABAAMAAABkAAQBAAAAAAUAAEAA\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request)
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
    answer = received.decode()
    assert answer.startswith("HTTP/1.1 422"), answer  # the body was read: merge_patch is no object
    assert '"field":"merge_patch"' in answer


def test_limits_of_a_task_type_set_listed_and_lifted(api: httpx.Client, server: DispatcherProcess,
                                                     store: tuple[redis.Redis, Settings]) -> None:
    client, settings = store
    queue = _queue()
    put = api.put(f"/queues/{queue}/limits/billing.charge", json={"concurrency": 50})
    assert put.status_code == 200 and put.json() == {"task_type": "billing.charge",
                                                     "concurrency": 50}
    api.put(f"/queues/{queue}/limits/emails.send", json={"rate": 10, "burst": 20})
    api.put(f"/queues/{queue}/limits/pdf.render",
            json={"breaker": {"failure_ratio": 0.1, "cooldown_s": 30}})
    client.hset(settings.keys.queue(queue).breaker("pdf.render"), "state", "open")  # read.lua's
    assert api.get(f"/queues/{queue}/limits").json() == [
        {"task_type": "billing.charge", "concurrency": 50},
        {"task_type": "emails.send", "rate": 10.0, "burst": 20},
        {"task_type": "pdf.render", "breaker": {"failure_ratio": 0.1, "cooldown_s": 30.0},
         "breaker_state": "open"}]
    # What every worker's read.lua reads (section 19).
    assert client.hget(settings.keys.queue(queue).limits, "billing.charge") == \
        b'{"concurrency":50}'
    assert api.delete(f"/queues/{queue}/limits/billing.charge").status_code == 204
    assert api.delete(f"/queues/{queue}/limits/billing.charge").status_code == 404
    writer = httpx.put(f"{server.url}/queues/{queue}/limits/emails.send", json={"rate": 1},
                       headers={"Authorization": f"Bearer {WRITE}"})
    assert writer.status_code == 403  # limits are an operator's


@pytest.mark.parametrize(("body", "field", "rule"), [
    ({"concurency": 5}, "limits.concurency", "unknown_field"),
    ({"concurrency": 0}, "limits.concurrency", "minimum"),
    ({"rate": "fast"}, "limits.rate", "type"),
    ({"burst": 3}, "limits.concurrency", "required"),
    ({"breaker": {"failure_ratio": 2}}, "limits.breaker.failure_ratio", "maximum"),
    ([5], "body", "type"),  # FastAPI checks the body is an object first
])
def test_limits_that_break_a_rule_are_refused_naming_it(api: httpx.Client, body: object,
                                                        field: str, rule: str) -> None:
    answer = api.put(f"/queues/{_queue()}/limits/billing.charge", json=body)
    assert answer.status_code == 422, answer.text
    assert [(v["field"], v["rule"]) for v in answer.json()["violations"]] == [(field, rule)]
