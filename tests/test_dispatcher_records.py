"""The dispatcher's endpoints built on task records, worker announcements and payload
schemas (docs/protocol.md, sections 14-16), against a real Redis, a real uvicorn process
and, for task states, a real Celery worker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import redis
from apps.periodic_app import create_app
from support import wait_for
from support.announce import announce as announce_worker
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from celery_ext.periodic import PeriodicScheduler, occurrence_task_id
from kombu_envelope import Envelope, Settings
from kombu_envelope.codec import decode_entry
from kombu_envelope.dispatcher.routes.tasks import BATCH_CHUNK
from kombu_envelope.envelope import PRIORITY_DEFAULT
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import bucket_for
from kombu_envelope.store.dead_letters import DeadLetters, dead_letter_envelope
from kombu_envelope.store.promoter import Promoter, redis_now_ms
from kombu_envelope.store.task_records import TaskRecords, TaskState
from kombu_envelope.testing.dispatcher import DispatcherProcess

TOKEN = "w-" + "d" * 30
PREFIX = f"t-dr-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, [{"name": "ops", "scope": "operator", "token": TOKEN}],
                           {"key_prefix": PREFIX, "schema_cache_s": 0}) as proc:
        yield proc


@pytest.fixture
def api(server: DispatcherProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        yield client


def announce(redis_url: str, queue: str, serves: dict[str, list[int]]) -> None:
    """A worker on ``queue`` seen just now, serving ``serves``."""
    announce_worker(redis_url, PREFIX, queue, serves)


@pytest.fixture
def queue(redis_url: str) -> str:
    name = f"q-{uuid.uuid4().hex[:8]}"
    announce(redis_url, name, {"bill.charge": [1, 2], "bill.any": []})
    return name


def test_post_queues_now_or_schedules_and_get_reports_it(api: httpx.Client, queue: str) -> None:
    now = api.post("/tasks", params={"queue": queue},
                   json={"task_type": "bill.charge", "payload": {"order": 1}})
    assert now.status_code == 201, now.text
    assert now.json()["state"] == "queued" and now.json()["entry_id"]
    later = api.post("/tasks", params={"queue": queue}, json={
        "task_type": "bill.charge",
        "schedule_time": (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()})
    assert later.status_code == 201 and later.json()["state"] == "scheduled"
    state = api.get(f"/tasks/{later.json()['task_id']}").json()
    assert state["state"] == "scheduled" and state["queue"] == queue
    assert state["task_type"] == "bill.charge" and state["due_at"]
    assert api.get("/tasks/no-such-task").json()["state"] == "unknown"


def test_duplicate_task_id_and_idempotency_key_enqueue_once(
        api: httpx.Client, queue: str, redis_url: str) -> None:
    body = {"task_type": "bill.charge", "task_id": f"dup-{uuid.uuid4().hex}"}
    first = api.post("/tasks", params={"queue": queue}, json=body)
    again = api.post("/tasks", params={"queue": queue}, json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["duplicate"] is True
    key = {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    keyed = [api.post("/tasks", params={"queue": queue}, headers=key,
                      json={"task_type": "bill.charge"}) for _ in range(2)]
    assert keyed[0].json()["task_id"] == keyed[1].json()["task_id"]
    assert [k.status_code for k in keyed] == [201, 200]
    client = redis.Redis.from_url(redis_url)
    stream = Settings(key_prefix=PREFIX).keys.queue(queue).task_streams[1]
    assert client.xlen(stream) == 2  # one entry per task, whatever was posted twice
    client.close()


def test_not_served_is_409_naming_what_is_served_and_versions_are_routed(
        api: httpx.Client, queue: str, redis_url: str) -> None:
    refused = api.post("/tasks", params={"queue": queue},
                       json={"task_type": "bill.charge", "payload_version": 3})
    assert refused.status_code == 409
    assert refused.json()["served"] == {"bill.charge": [1, 2], "bill.any": []}
    other = f"q-{uuid.uuid4().hex[:8]}"
    announce(redis_url, other, {"bill.charge": [3]})
    routed = api.post("/tasks", json={"task_type": "bill.charge", "payload_version": 3})
    assert routed.status_code == 201 and routed.json()["queue"] == other
    nobody = api.post("/tasks", json={"task_type": "nobody.serves"})
    assert nobody.status_code == 409 and nobody.json()["error"] == "not_served"


def test_batch_answers_each_item(api: httpx.Client, queue: str) -> None:
    answer = api.post("/tasks:batch", json={"queue": queue, "tasks": [
        {"task_type": "bill.charge"}, {"task_type": "bill.charge", "priority": -1},
        {"task_type": "bill.unknown"}, {"task_type": "bill.any", "payload_version": 9}]})
    assert answer.status_code == 200, answer.text
    items = answer.json()["items"]
    assert [i["status"] for i in items] == [201, 422, 409, 201]
    assert items[1]["problem"]["violations"][0]["rule"] == "range"


def test_batch_items_posted_again_are_duplicates_and_new_ones_are_not(
        api: httpx.Client, queue: str) -> None:
    given = {"task_type": "bill.charge", "task_id": f"b-{uuid.uuid4().hex}"}
    first = api.post("/tasks:batch", json={"queue": queue, "tasks": [given]}).json()["items"]
    again = api.post("/tasks:batch", json={"queue": queue, "tasks": [
        given, {"task_type": "bill.charge"}, {"task_type": "bill.charge"}]}).json()["items"]
    assert [i["status"] for i in first] == [201]
    assert [i["status"] for i in again] == [200, 201, 201]
    assert again[0]["task"]["duplicate"] and again[0]["task"]["state"] == "queued"
    assert again[1]["task"]["task_id"] != again[2]["task"]["task_id"]


def test_a_batch_of_several_chunks_is_answered_and_enqueued_in_posted_order(
        api: httpx.Client, queue: str, redis_url: str) -> None:
    """Chunks are checked while the chunk before is published: answers and stream
    entries still follow the posted order, a bad task in any chunk answered alone."""
    count = 2 * BATCH_CHUNK + 50
    bad = {3, BATCH_CHUNK, BATCH_CHUNK + 1, count - 1}
    tasks = [{"task_type": "bill.charge", "priority": -1} if index in bad else
             {"task_type": "bill.charge", "task_id": f"c-{index}-{uuid.uuid4().hex[:6]}"}
             for index in range(count)]
    items = api.post("/tasks:batch", json={"queue": queue, "tasks": tasks}).json()["items"]
    assert [item["index"] for item in items] == list(range(count))
    assert [item["status"] for item in items] == [422 if i in bad else 201 for i in range(count)]
    stream = Settings(key_prefix=PREFIX).keys.queue(queue).stream(bucket_for(PRIORITY_DEFAULT))
    entries = redis.Redis.from_url(redis_url).xrange(stream)
    assert [decode_entry(fields).task_id for _, fields in entries] == [
        task["task_id"] for task in tasks if "task_id" in task]


def test_schemas_register_enforce_list_delete(api: httpx.Client, queue: str) -> None:
    schema = {"type": "object", "properties": {"order": {"type": "integer"}},
              "required": ["order"], "additionalProperties": False}
    assert api.post("/schemas/bill.charge/2", json=schema).status_code == 200
    assert api.get("/schemas/bill.charge/2").json()["schema"] == schema
    assert any(s["task_type"] == "bill.charge" for s in api.get("/schemas").json())
    bad = api.post("/tasks", params={"queue": queue}, json={
        "task_type": "bill.charge", "payload_version": 2, "payload": {"order": "x"}})
    assert bad.status_code == 422
    assert bad.json()["violations"][0]["field"] == "payload.order"
    assert bad.json()["violations"][0]["rule"] == "schema"
    extra = api.post("/tasks", params={"queue": queue}, json={
        "task_type": "bill.charge", "payload_version": 2, "payload": {"order": 1, "x": 1}})
    assert extra.status_code == 422 and extra.json()["violations"][0]["rule"] == "schema"
    unknown_version = api.post("/tasks", params={"queue": queue}, json={
        "task_type": "bill.charge", "payload_version": 7, "payload": {"order": "x"}})
    assert unknown_version.status_code == 409  # no schema for 7, and no worker serves it
    invalid = api.post("/schemas/bill.charge/3", json={"type": "no-such-type"})
    assert invalid.status_code == 422 and invalid.json()["violations"][0]["field"] == "schema"
    assert api.delete("/schemas/bill.charge/2").status_code == 204
    assert api.get("/schemas/bill.charge/2").status_code == 404


def test_state_of_a_task_run_by_a_celery_worker(api: httpx.Client, redis_url: str) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"TEST_BROKER_URL": redis_url.replace("redis://", "envelope://"),
           "TEST_KEY_PREFIX": PREFIX, "TEST_LEASE_MS": "1500"}
    with CeleryWorker("apps.envelope_app", queues=[queue], env=env):
        posted = api.post("/tasks", params={"queue": queue}, json={
            "task_type": "envelope_app.add", "payload": {"x": 1, "y": 2}})
        assert posted.status_code == 201, posted.text
        task_id = posted.json()["task_id"]
        wait_for(lambda: api.get(f"/tasks/{task_id}").json()["state"] == "succeeded",
                 timeout=20)
    state = api.get(f"/tasks/{task_id}").json()
    assert state["language"] == "python" and state["attempts"] == 1
    assert state["worker"] and state["started_at"] and state["finished_at"]


def test_workers_lists_the_announcements(api: httpx.Client, queue: str) -> None:
    listed = api.get("/workers", params={"queue": queue}).json()
    assert [(w["language"], w["queues"], w["serves"], w["live"]) for w in listed] == [
        ("python", [queue], {"bill.charge": [1, 2], "bill.any": []}, False)]  # no liveness key
    assert listed[0]["seen_at"] is not None and listed[0]["stopped_at"] is None
    assert api.get("/workers", params={"queue": "nobody-" + queue}).json() == []
    assert api.get("/workers", params={"queue": "{bad}"}).status_code == 422


def test_replay_dry_run_checks_the_payload_schema_and_publishes_nothing(
        api: httpx.Client, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    settings = Settings(key_prefix=PREFIX)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    envelope = Envelope.new(task_type="bill.refund", payload={"order": "x"})
    entry_id = dead_letter_envelope(
        client, settings, queue=queue, envelope=envelope, consumer="c1",
        failure=Failure(FailureClass.INVALID_PAYLOAD, "order", task_id=envelope.task_id,
                        task_type="bill.refund"))
    schema = {"type": "object", "properties": {"order": {"type": "integer"}}}
    assert api.post("/schemas/bill.refund/2", json=schema).status_code == 200
    replay = f"/dead-letters/{queue}/{entry_id}/replay"
    broken = api.post(replay, params={"dry_run": "true"}, json={"bump_version": True})
    assert broken.status_code == 422
    assert broken.json()["violations"][0]["field"] == "payload.order"
    assert broken.json()["violations"][0]["rule"] == "schema"
    fixed = api.post(replay, params={"dry_run": "true"},
                     json={"bump_version": True, "payload": {"order": 7}})
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["new_id"] is None
    assert fixed.json()["envelope"]["payload"] == {"order": 7}
    assert fixed.json()["envelope"]["payload_version"] == 2
    assert [e.entry_id for e in DeadLetters(client, settings).list([queue])] == [entry_id]
    assert api.post(f"/dead-letters/{queue}/1-0/replay", params={"dry_run": "true"}
                    ).status_code == 404
    api.delete("/schemas/bill.refund/2")
    client.close()


def test_state_of_a_periodic_occurrence_from_scheduled_to_succeeded(
        api: httpx.Client, redis_url: str) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    settings = Settings(key_prefix=PREFIX)
    client = redis.Redis.from_url(redis_url)
    app = create_app(envelope_url(redis_url), redis_url, PREFIX,
                     {"tick": {"every": 1, "options": {"queue": queue}}})
    records = TaskRecords(client, settings)
    try:
        scheduler = PeriodicScheduler(app, client, settings)
        scheduler.sync()
        due = int(client.hget(settings.keys.queue(queue).periodic, "tick"))
        assert scheduler.run_due(due)[0] == 1  # stored ahead of its time: still delayed
        task_id = occurrence_task_id(PREFIX, "tick", due)
        due_at = datetime.fromtimestamp(due / 1000, tz=timezone.utc)
        record = records.get(task_id)
        assert (record.state, record.queue, record.due_at) == (TaskState.SCHEDULED, queue, due_at)
        shown = api.get(f"/tasks/{task_id}").json()
        assert (shown["state"], shown["queue"]) == ("scheduled", queue)
        assert datetime.fromisoformat(shown["due_at"].replace("Z", "+00:00")) == due_at
        assert shown["task_type"] == "periodic_app.record" and shown["published_at"]

        promoter = Promoter(lambda: client, settings)
        wait_for(lambda: promoter.promote_queue(queue, redis_now_ms(client))[0] == 1,
                 timeout=10)
        assert records.get(task_id).state is TaskState.QUEUED
        assert api.get(f"/tasks/{task_id}").json()["state"] == "queued"

        env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_REDIS_URL": redis_url,
               "TEST_KEY_PREFIX": PREFIX, "TEST_BEAT_SCHEDULE": "{}"}
        with CeleryWorker("apps.periodic_app", queues=[queue], env=env):
            wait_for(lambda: records.get(task_id).state is TaskState.SUCCEEDED, timeout=20)
        assert api.get(f"/tasks/{task_id}").json()["state"] == "succeeded"
    finally:
        app.close()
        client.close()
