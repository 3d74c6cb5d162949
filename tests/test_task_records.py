"""Task records and worker announcements (docs/protocol.md, sections 14 and 15), as a
reader sees them through :class:`TaskRecords` and :class:`Announcements`, written by
real ``celery worker`` processes on a real Redis.

One solo worker consumes ``celery`` for the whole module; the last test stops it
cleanly. A second worker, on its own queue, is SIGKILLed while it runs a task.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import kombu
import pytest
import redis
from apps.reliable_app import create_app
from celery import Celery
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import CeleryWorker

from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import Announcements
from kombu_envelope.store.dead_letters import DeadLetterFilter, DeadLetters
from kombu_envelope.store.delayed import CancelOutcome, DelayedTasks
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.task_records import TaskRecord, TaskRecords, TaskState, record_write

APP = "apps.reliable_app"
PLAIN_TRANSPORT = "kombu_envelope.kombu.transport:Transport"
LEASE_MS = 1500
TIMEOUT = 20

pytestmark = pytest.mark.timeout(90)


def worker_env(redis_url: str, prefix: str) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(LEASE_MS)}


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def settings(prefix: str) -> Settings:
    return Settings(key_prefix=prefix, lease_ms=LEASE_MS)


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    with CeleryWorker(APP, env=worker_env(redis_url, prefix)) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix, LEASE_MS)
    yield app
    app.close()


@pytest.fixture
def records(redis_client: redis.Redis, settings: Settings) -> TaskRecords:
    return TaskRecords(redis_client, settings)


def hold_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:probe:hold:{order_id}"


def reaches(records: TaskRecords, task_id: str, state: TaskState, queue: str | None = None,
            timeout: float = TIMEOUT) -> TaskRecord:
    """Wait until the record of ``task_id`` reads ``state``; return it."""
    seen: list[TaskRecord] = []

    def read() -> TaskRecord | None:
        seen.append(records.get(task_id, queue))
        return seen[-1] if seen[-1].state is state else None

    return wait_for(read, timeout=timeout, interval=0.05,
                    message=lambda: f"{task_id} never read {state.value}: last {seen[-1]}")


def test_a_record_spec_carries_its_fields_and_the_expiry_of_its_state() -> None:
    settings = Settings(task_record_retention_s=10)
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    due = now + timedelta(hours=1)
    write = record_write(settings, "q", "t-1", TaskState.RETRYING,
                         {"due_at": due, "error": "x" * 2000, "worker": None},
                         due_ms=int(due.timestamp() * 1000), now=now)
    assert write.keys == [settings.keys.queue("q").task_record("t-1")]
    spec = json.loads(write.args[0])
    assert spec["ttl_ms"] == 7 * 24 * 3_600_000 + 3_600_000  # 7 days after its due time
    assert spec["fields"] == {"state": "retrying", "updated_at": "2026-01-02T03:04:05.678Z",
                              "due_at": "2026-01-02T04:04:05.678Z", "error": "x" * 1000}
    assert "dead_ttl_ms" not in spec
    takeover = json.loads(record_write(settings, "q", "t-1", TaskState.QUEUED, may_die=True,
                                       now=now).args[0])
    assert (takeover["ttl_ms"], takeover["dead_ttl_ms"]) == (7 * 24 * 3_600_000, 10_000)
    assert json.loads(record_write(settings, "q", "t-1", TaskState.SUCCEEDED,
                                   now=now).args[0])["ttl_ms"] == 10_000
    off = record_write(Settings(task_record_retention_s=0), "q", "t-1", TaskState.QUEUED)
    assert (off.keys, off.args) == ([], [])


def test_one_publish_many_writes_each_task_its_own_record(
        redis_client: redis.Redis, records: TaskRecords, settings: Settings) -> None:
    queue = f"shapes-{uuid.uuid4().hex[:8]}"
    envelopes = [Envelope.new(task_type="order.close"), Envelope.new(task_type="order.close"),
                 Envelope.new(task_type="order.open", payload_version=2),
                 Envelope.new(task_type="order.close", retry_count=1),
                 Envelope.new(task_type="order.close", schedule_time=utcnow() + timedelta(hours=1))]
    Publisher(redis_client, settings).publish_many([(queue, envelope) for envelope in envelopes])
    read = [records.get(envelope.task_id, queue) for envelope in envelopes]
    assert [(record.task_id, record.task_type, record.payload_version, record.retry_count,
             record.state) for record in read] == [
        (envelopes[0].task_id, "order.close", 1, 0, TaskState.QUEUED),
        (envelopes[1].task_id, "order.close", 1, 0, TaskState.QUEUED),
        (envelopes[2].task_id, "order.open", 2, 0, TaskState.QUEUED),
        (envelopes[3].task_id, "order.close", 1, 1, TaskState.QUEUED),
        (envelopes[4].task_id, "order.close", 1, 0, TaskState.SCHEDULED)]
    assert read[0].published_at == read[2].published_at == read[4].published_at
    assert read[4].due_at is not None and read[0].due_at is None


def test_a_task_without_record_reads_unknown(records: TaskRecords) -> None:
    assert records.get("no-such-task").state is TaskState.UNKNOWN
    assert records.get("no-such-task", "celery").state is TaskState.UNKNOWN


def test_a_delayed_task_reads_scheduled_running_then_succeeded(
        app: Celery, worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        prefix: str) -> None:
    order = uuid.uuid4().hex
    redis_client.set(hold_key(prefix, order), 1)
    result = app.tasks["reliable.effect"].apply_async(
        kwargs={"order_id": order, "hold": True}, countdown=1.0)
    scheduled = records.get(result.id)
    assert scheduled.state is TaskState.SCHEDULED
    assert (scheduled.queue, scheduled.task_type, scheduled.payload_version) == \
        ("celery", "reliable.effect", 1)
    assert scheduled.due_at is not None and scheduled.due_at > utcnow()
    assert scheduled.published_at is not None and scheduled.attempts == 0
    running = reaches(records, result.id, TaskState.RUNNING)
    assert (running.language, running.attempts, running.host) == ("python", 1,
                                                                  socket.gethostname())
    assert running.worker and running.pid and running.started_at is not None
    redis_client.delete(hold_key(prefix, order))
    assert result.get(timeout=TIMEOUT) == 1
    done = reaches(records, result.id, TaskState.SUCCEEDED)
    assert done.finished_at is not None and done.finished_at >= running.started_at
    assert done.worker == running.worker and done.reason is None
    ttl = redis_client.pttl(records.record_key("celery", result.id))
    assert 0 < ttl <= 3_600_000


def test_prefork_children_record_each_start_and_success_sent_without_waiting(
        redis_client: redis.Redis, redis_url: str) -> None:
    # A child sends both records without waiting for their replies (they are read
    # before its next write): every one lands, in order, from the child that ran it.
    # Under a prefix of its own, so that the module's announcements never list it.
    own = f"t-{uuid.uuid4().hex[:10]}"
    records = TaskRecords(redis_client, Settings(key_prefix=own, lease_ms=LEASE_MS))
    app = create_app(envelope_url(redis_url), redis_url, own, LEASE_MS)
    with CeleryWorker(APP, pool="prefork", concurrency=2, queues=["forked"],
                      env=worker_env(redis_url, own)) as forked:
        results = [app.tasks["reliable.effect"].apply_async(
            kwargs={"order_id": uuid.uuid4().hex}, queue="forked") for _ in range(30)]
        assert [result.get(timeout=TIMEOUT) for result in results] == [1] * 30
        done = [reaches(records, result.id, TaskState.SUCCEEDED, "forked")
                for result in results]
        parent = forked.pid
    app.close()
    assert {record.attempts for record in done} == {1}
    assert all(record.finished_at is not None and record.started_at is not None
               and record.finished_at >= record.started_at for record in done)
    assert parent not in {record.pid for record in done}  # written by the children
    assert 1 <= len({record.pid for record in done}) <= 2


def test_a_promoted_task_nobody_consumes_reads_queued(
        worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        settings: Settings) -> None:
    envelope = Envelope.new(task_type="nobody.runs", payload={},
                            schedule_time=utcnow() + timedelta(seconds=0.5))
    Publisher(redis_client, settings).publish("unconsumed", envelope)
    assert records.get(envelope.task_id).state is TaskState.SCHEDULED
    # The worker's promoter moves it; the record still says scheduled, and reads queued.
    queued = reaches(records, envelope.task_id, TaskState.QUEUED)
    assert queued.raw["state"] == "scheduled" and queued.queue == "unconsumed"
    assert "unconsumed" in records.known_queues()


def test_a_retried_task_reads_retrying_then_dead_then_failed_once_purged(
        app: Celery, worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        settings: Settings) -> None:
    result = app.tasks["reliable.retry_then_fail"].delay(uuid.uuid4().hex)
    retrying = reaches(records, result.id, TaskState.RETRYING)
    assert retrying.retry_count == 1 and retrying.due_at is not None
    assert retrying.error is not None and retrying.error.startswith("ValueError: ")
    dead = reaches(records, result.id, TaskState.DEAD)
    assert dead.dead_id and dead.finished_at is not None and dead.attempts == 2
    assert dead.error is not None and "ValueError" in dead.error
    letters = DeadLetters(redis_client, settings)
    assert letters.get("celery", dead.dead_id) is not None
    assert letters.purge("celery", DeadLetterFilter(task_type="reliable.retry_then_fail")) == 1
    assert records.get(result.id).state is TaskState.FAILED


def test_cancelled_while_delayed_and_when_skipped_at_the_worker(
        app: Celery, worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        settings: Settings) -> None:
    effect = app.tasks["reliable.effect"]
    delayed = effect.apply_async(kwargs={"order_id": uuid.uuid4().hex}, countdown=60)
    assert records.get(delayed.id).state is TaskState.SCHEDULED
    cancels = DelayedTasks(redis_client, settings)
    assert cancels.cancel(delayed.id, "celery") is CancelOutcome.REMOVED
    cancelled = records.get(delayed.id)
    assert (cancelled.state, cancelled.reason) == (TaskState.CANCELLED, "cancelled")
    assert cancelled.finished_at is not None
    # Marked before it is published: the worker acknowledges it without running it.
    skipped_id = uuid.uuid4().hex
    assert cancels.cancel(skipped_id, "celery") is CancelOutcome.MARKED
    time.sleep(settings.cancel_check_ms / 1000)  # past the consumer's "no marks" cache
    effect.apply_async(kwargs={"order_id": uuid.uuid4().hex}, task_id=skipped_id)
    skipped = reaches(records, skipped_id, TaskState.CANCELLED)
    assert skipped.reason == "cancelled" and skipped.attempts == 0


def test_a_duplicate_reads_succeeded_with_reason_duplicate(
        app: Celery, worker: CeleryWorker, records: TaskRecords) -> None:
    effect = app.tasks["reliable.effect"]
    order = uuid.uuid4().hex
    assert effect.delay(order).get(timeout=TIMEOUT) == 1
    duplicate = effect.delay(order)
    assert duplicate.get(timeout=TIMEOUT) is None
    record = reaches(records, duplicate.id, TaskState.SUCCEEDED)
    assert record.reason == "duplicate" and record.finished_at is not None


def test_a_task_of_a_sigkilled_worker_reads_queued_then_is_taken_over(
        app: Celery, worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        redis_url: str, prefix: str) -> None:
    order = uuid.uuid4().hex
    redis_client.set(hold_key(prefix, order), 1)
    with CeleryWorker(APP, queues=["doomed"], env=worker_env(redis_url, prefix)) as doomed:
        result = app.tasks["reliable.effect"].apply_async(
            kwargs={"order_id": order, "hold": True}, queue="doomed")
        running = reaches(records, result.id, TaskState.RUNNING)
        assert doomed.pid is not None
        doomed.kill()
    redis_client.delete(hold_key(prefix, order))
    # Its liveness key expires after the lease: the task reads queued again.
    queued = reaches(records, result.id, TaskState.QUEUED, timeout=LEASE_MS / 1000 + 5)
    assert queued.raw["state"] == "running" and queued.worker == running.worker
    (killed,) = [a for a in Announcements(records.client, records.settings).workers("doomed")
                 if a.consumer == running.worker]
    assert not killed.live and killed.stopped_at is None  # recently seen, not live
    # The module's worker starts consuming the queue and takes the entry over.
    app.control.add_consumer("doomed", destination=[worker.hostname], reply=True)
    done = reaches(records, result.id, TaskState.SUCCEEDED)
    assert done.attempts == 2 and done.worker != running.worker
    assert result.get(timeout=TIMEOUT) == 1


def test_records_expire_and_retention_zero_writes_none(
        redis_client: redis.Redis, prefix: str) -> None:
    short = Settings(key_prefix=prefix, task_record_retention_s=1)
    envelope = Envelope.new(task_type="nobody.runs", payload={},
                            schedule_time=utcnow() + timedelta(hours=1))
    Publisher(redis_client, short).publish("expiring", envelope)
    records = TaskRecords(redis_client, short)
    key = records.record_key("expiring", envelope.task_id)
    # An open record outlives its due time by 7 days, whatever the retention.
    assert redis_client.pttl(key) > 7 * 24 * 3_600_000
    DelayedTasks(redis_client, short).cancel(envelope.task_id, "expiring")
    assert 0 < redis_client.pttl(key) <= 1000
    assert records.get(envelope.task_id).state is TaskState.CANCELLED
    wait_for(lambda: records.get(envelope.task_id).state is TaskState.UNKNOWN, timeout=3)

    off = Settings(key_prefix=prefix, task_record_retention_s=0)
    later = Envelope.new(task_type="nobody.runs", payload={},
                         schedule_time=utcnow() + timedelta(hours=1))
    Publisher(redis_client, off).publish("expiring", later)
    assert not redis_client.exists(records.record_key("expiring", later.task_id))
    # No record, but delayed: scheduled.
    assert records.get(later.task_id).state is TaskState.SCHEDULED


def test_a_live_worker_announces_its_queues_and_tasks(
        worker: CeleryWorker, app: Celery, redis_client: redis.Redis,
        settings: Settings) -> None:
    announcements = Announcements(redis_client, settings)
    (live,) = [a for a in announcements.workers("celery") if a.live]
    assert live.language == "python" and live.concurrency == 1 and live.stopped_at is None
    assert live.serves["reliable.versioned"] == [1, 2]
    assert live.serves["reliable.effect"] == [1]
    assert not [name for name in live.serves if name.startswith("celery.")]
    assert live.started_at is not None and live.seen_at is not None
    assert announcements.served("celery", "reliable.versioned", 2)
    assert not announcements.served("celery", "reliable.versioned", 3)
    assert not announcements.served("celery", "no.such.task", 1)
    assert not announcements.served("elsewhere", "reliable.effect", 1)
    # A queue added at run time is announced too (the SIGKILL test above adds the same
    # one; adding it twice is a no-op); no transient queue shows.
    app.control.add_consumer("doomed", destination=[worker.hostname], reply=True)
    wait_for(lambda: announcements.serving_queues("reliable.versioned", 1)
             == ["celery", "doomed"], timeout=LEASE_MS / 1000 + 5,
             message=lambda: str(announcements.workers()))
    assert announcements.serving_queues("reliable.versioned", 3) == []
    assert announcements.serves_on("celery")["reliable.versioned"] == [1, 2]
    assert "celery" in TaskRecords(redis_client, settings).known_queues()


def test_the_kombu_transport_alone_announces_its_queues_and_serves_nothing(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    options = {"key_prefix": key_prefix,
               "message_adapter": "kombu_envelope.kombu.adapter:MessageAdapter"}
    announcements = Announcements(redis_client, Settings(key_prefix=key_prefix))
    with kombu.Connection(envelope_url(redis_url), transport=PLAIN_TRANSPORT,
                          transport_options=options) as conn, \
            conn.Consumer(kombu.Queue("plain", routing_key="plain"), callbacks=[]):
        (live,) = announcements.workers("plain")
        assert (live.live, live.queues, live.serves, live.concurrency) == \
            (True, ["plain"], {}, None)
    (stopped,) = announcements.workers("plain")
    assert not stopped.live and stopped.stopped_at is not None


def test_a_stopped_worker_stays_recently_seen_and_a_replay_reads_queued(
        app: Celery, worker: CeleryWorker, records: TaskRecords, redis_client: redis.Redis,
        settings: Settings) -> None:
    result = app.tasks["reliable.invalid"].delay(uuid.uuid4().hex)
    dead = reaches(records, result.id, TaskState.DEAD)
    assert dead.dead_id is not None and dead.error is not None
    assert dead.error.startswith("celery_ext.failures.InvalidPayload: ")
    consumer = dead.worker
    assert consumer is not None
    worker.stop()
    announcements = Announcements(redis_client, settings)
    (stopped,) = [a for a in announcements.workers("celery") if a.consumer == consumer]
    assert not stopped.live and stopped.stopped_at is not None
    assert announcements.served("celery", "reliable.invalid", 1)  # recently seen
    keep_ms = redis_client.pttl(settings.keys.worker(consumer))
    assert 3_500_000 < keep_ms <= 3_600_000
    # Nobody consumes the queue now: the replayed task stays queued.
    assert DeadLetters(redis_client, settings).replay("celery", dead.dead_id) is not None
    replayed = records.get(result.id)
    assert (replayed.state, replayed.retry_count) == (TaskState.QUEUED, 0)
