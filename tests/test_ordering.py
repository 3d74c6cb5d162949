"""Ordering keys (docs/protocol.md, section 20): the scripts, and a real Celery worker.

The script-level cases drive the steps a consumer takes (read, acknowledge with the key's
advance, dead-letter) by hand against a real Redis, and let a promoter release each next
head. The Celery cases run :mod:`apps.limits_app` in a prefork worker with Celery's
defaults (early acknowledgement), so the key is held by the run, not by its entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from apps.limits_app import create_app
from celery import Celery
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR, CeleryWorker

from kombu_envelope.codec import ENC_JSON, decode_entry, encode_body
from kombu_envelope.envelope import Envelope, utcnow
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters, dead_letter_pending
from kombu_envelope.store.ordering import (
    OnDeadLetter,
    OrderingKeys,
    add_advance,
    held_member,
)
from kombu_envelope.store.promoter import Promoter
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.queues import Queues

QUEUE = "ordered"
GROUP = Settings().consumer_group


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix, lease_ms=1000)


@pytest.fixture
def publisher(redis_client: redis.Redis, settings: Settings) -> Publisher:
    return Publisher(redis_client, settings)


def keyed(key: str, task_id: str, **fields: object) -> Envelope:
    return Envelope.new(task_type="order.step", task_id=task_id, ordering_key=key, **fields)


def stream_ids(client: redis.Redis, settings: Settings) -> list[str]:
    """The task_ids in the queue's streams, oldest first."""
    found = []
    for stream in settings.keys.queue(QUEUE).task_streams:
        for _, fields in client.xrange(stream):
            found.append(decode_entry(fields).task_id)
    return found


def take(client: redis.Redis, settings: Settings) -> list[tuple[str, str, Envelope]]:
    """Read every new entry of the queue as one consumer: (stream, entry id, Envelope)."""
    taken = []
    for stream in settings.keys.queue(QUEUE).task_streams:
        try:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass
        for _, entries in client.xreadgroup(GROUP, "c1", {stream: ">"}) or []:
            for entry_id, fields in entries:
                taken.append((stream, entry_id.decode(), decode_entry(fields)))
    return taken


def ack(client: redis.Redis, settings: Settings, stream: str, entry_id: str,
        envelope: Envelope) -> None:
    """A success's acknowledgement: XACK, XDEL and the key's advance in one MULTI."""
    pipe = client.pipeline(transaction=True)
    pipe.xack(stream, GROUP, entry_id)
    pipe.xdel(stream, entry_id)
    add_advance(pipe, settings.keys.queue(QUEUE), envelope.ordering_key, envelope.task_id)
    pipe.execute()


def promote(client: redis.Redis, settings: Settings) -> None:
    Promoter(lambda: client, settings).run_once()


def test_only_the_head_of_a_key_is_in_a_stream_and_each_next_one_follows_its_ack(
        redis_client: redis.Redis, settings: Settings, publisher: Publisher) -> None:
    # Given three tasks of key A and one of key B, published in that order
    ids = [publisher.publish(QUEUE, keyed("A", f"a{i}")) for i in range(3)]
    publisher.publish(QUEUE, keyed("B", "b0"))

    # Then the heads of A and B are in the stream; the others wait, answered "waiting"
    assert ids[1:] == ["waiting", "waiting"]
    assert stream_ids(redis_client, settings) == ["a0", "b0"]
    keys = settings.keys.queue(QUEUE)
    assert redis_client.lrange(keys.order("A"), 0, -1) == [b"a0", b"a1", b"a2"]
    assert redis_client.sismember(settings.keys.queues, QUEUE)  # promoters serve it

    # When each head is acknowledged and a promoter runs, the next one comes, in order
    order = []
    for _ in range(3):
        taken = [t for t in take(redis_client, settings) if t[2].ordering_key == "A"]
        assert len(taken) == 1
        order.append(taken[0][2].task_id)
        ack(redis_client, settings, *taken[0])
        promote(redis_client, settings)
    assert order == ["a0", "a1", "a2"]
    assert not redis_client.exists(keys.order("A"), keys.order_waiting("A"), keys.order_advanced)


def test_a_retry_keeps_the_head_and_a_delayed_task_joins_when_due(
        redis_client: redis.Redis, settings: Settings, publisher: Publisher) -> None:
    # Given a head, a task delayed by 0.2 s, then a due one, all of key K
    publisher.publish(QUEUE, keyed("K", "first"))
    publisher.publish(QUEUE, keyed("K", "later", schedule_time=utcnow() + timedelta(seconds=0.2)))
    publisher.publish(QUEUE, keyed("K", "second"))
    (stream, entry_id, head), = take(redis_client, settings)

    # When the head is retried (its next attempt published again under its task_id)
    redis_client.xack(stream, GROUP, entry_id)
    redis_client.xdel(stream, entry_id)
    publisher.publish(QUEUE, head.model_copy(update={"retry_count": 1}))

    # Then it is still the head and goes straight to its stream; the delayed task joins
    # behind "second" once due
    assert stream_ids(redis_client, settings) == ["first"]
    time.sleep(0.25)
    promote(redis_client, settings)
    keys = settings.keys.queue(QUEUE)
    assert redis_client.lrange(keys.order("K"), 0, -1) == [b"first", b"second", b"later"]


@pytest.mark.parametrize("policy", [None, OnDeadLetter.HALT])
def test_a_dead_lettered_head_moves_its_key_on_or_halts_it_by_policy(
        redis_client: redis.Redis, settings: Settings, publisher: Publisher,
        policy: OnDeadLetter | None) -> None:
    keys = OrderingKeys(redis_client, settings)
    if policy is not None:
        keys.set_policy(QUEUE, "order.step", policy)
    publisher.publish(QUEUE, keyed("D", "doomed"))
    publisher.publish(QUEUE, keyed("D", "next"))
    (stream, entry_id, _), = take(redis_client, settings)

    dead_letter_pending(redis_client, settings, queue=QUEUE, stream=stream, entry_id=entry_id,
                        failure=Failure(FailureClass.TASK_ERROR, "boom", task_id="doomed",
                                        task_type="order.step"), consumer="c1")
    promote(redis_client, settings)

    state = keys.state(QUEUE, "D")
    if policy is None:
        assert stream_ids(redis_client, settings) == ["next"] and state.halted_for is None
        return
    assert stream_ids(redis_client, settings) == [] and state.halted_for == "doomed"
    # An operator replays the dead letter: the halt clears and it runs again as the head
    letters = DeadLetters(redis_client, settings)
    (dead,) = list(letters.iter(QUEUE))
    letters.replay(QUEUE, dead.entry_id)
    assert stream_ids(redis_client, settings) == ["doomed"]
    assert keys.state(QUEUE, "D").halted_for is None


def test_an_operator_skips_a_head_and_cancelling_a_delayed_head_moves_the_key_on(
        redis_client: redis.Redis, settings: Settings, publisher: Publisher) -> None:
    keys = OrderingKeys(redis_client, settings)
    publisher.publish(QUEUE, keyed("S", "lost"))
    publisher.publish(QUEUE, keyed("S", "after"))
    take(redis_client, settings)  # "lost" is read and its entry then vanishes by hand
    assert keys.skip(QUEUE, "S") == "lost"
    promote(redis_client, settings)
    assert stream_ids(redis_client, settings)[-1] == "after"
    assert keys.state(QUEUE, "S").head == "after"


def test_a_hold_of_a_run_acknowledged_early_expires_into_an_advance_only_without_its_entry(
        redis_client: redis.Redis, key_prefix: str, publisher: Publisher) -> None:
    settings = Settings(key_prefix=key_prefix, lease_ms=1)
    keys = OrderingKeys(redis_client, settings)
    Publisher(redis_client, settings).publish(QUEUE, keyed("H", "run"))
    Publisher(redis_client, settings).publish(QUEUE, keyed("H", "waits"))
    (stream, entry_id, _), = take(redis_client, settings)
    member = held_member("H", "run", stream, entry_id)

    # A hold whose entry is still there (to be taken over and run again) leaves the key
    keys.hold(QUEUE, member)
    time.sleep(0.01)
    promote(redis_client, settings)
    assert keys.state(QUEUE, "H").head == "run"
    # One whose entry was acknowledged early (its worker died mid-run) moves it on
    redis_client.xack(stream, GROUP, entry_id)
    redis_client.xdel(stream, entry_id)
    keys.hold(QUEUE, member)
    time.sleep(0.01)
    promote(redis_client, settings)
    assert keys.state(QUEUE, "H").head == "waits"
    assert "waits" in stream_ids(redis_client, settings)


def test_a_purge_deletes_the_tasks_waiting_for_their_turn(
        redis_client: redis.Redis, settings: Settings, publisher: Publisher) -> None:
    queues = Queues(redis_client, settings)
    queues.declare(QUEUE)
    for index in range(3):
        publisher.publish(QUEUE, keyed("P", f"p{index}"))
    assert queues.purge(QUEUE) == 3  # the head and two waiting
    keys = settings.keys.queue(QUEUE)
    assert not redis_client.exists(keys.order("P"), keys.order_waiting("P"))


def test_a_keyed_envelope_is_never_compressed_and_a_bad_key_or_policy_is_refused() -> None:
    big = keyed("Z", "big", payload={"blob": "x" * 20_000})
    assert encode_body(big, 8192)[0] == ENC_JSON
    with pytest.raises(InvalidEnvelope) as refused:
        Envelope.new(task_type="t", ordering_key="has space")
    assert [(v.field, v.rule) for v in refused.value.violations] == [("ordering_key", "pattern")]


def test_an_unknown_policy_is_refused_naming_it(redis_client: redis.Redis,
                                                settings: Settings) -> None:
    with pytest.raises(InvalidEnvelope, match="'advance' or 'halt'"):
        OrderingKeys(redis_client, settings).set_policy(QUEUE, "t", "skip")


# ---------------------------------------------------------------------- Celery

CELERY_QUEUE = "ordered-celery"
LEASE_MS = 1500
POLICY = {"ordering.step": "halt"}


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def worker(redis_url: str, prefix: str) -> Iterator[CeleryWorker]:
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": prefix, "TEST_LEASE_MS": str(LEASE_MS),
           "TEST_ORDERING_POLICY": json.dumps(POLICY)}
    with CeleryWorker("apps.limits_app", pool="prefork", concurrency=4, queues=[CELERY_QUEUE],
                      env=env) as started:
        yield started


@pytest.fixture(scope="module")
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, prefix, LEASE_MS)
    yield app
    app.close()


def test_celery_runs_each_key_one_at_a_time_in_publish_order_with_retries(
        worker: CeleryWorker, app: Celery, redis_client: redis.Redis, prefix: str) -> None:
    # Given 3 keys x 5 tasks, interleaved, every third failing once (retried in 0.1 s)
    plan = [(f"k{k}", i) for i in range(5) for k in range(3)]
    ids = {}
    for key, index in plan:
        ids[key, index] = app.send_task(
            "ordering.step", kwargs={"log": f"{prefix}-{key}", "sleep_ms": 30,
                                     "fail_once": index % 3 == 1},
            queue=CELERY_QUEUE, headers={"ordering_key": key}).id

    # Then per key: every task ran alone (start, [start after a failure,] end) in order
    def logs() -> dict[str, list[str]] | None:
        found = {key: [e.decode() for e in redis_client.lrange(f"{prefix}:mx:log:{prefix}-{key}",
                                                                 0, -1)]
                 for key in ("k0", "k1", "k2")}
        return found if all(sum(e.startswith("end") for e in v) == 5 for v in found.values()) \
            else None

    found = wait_for(logs, timeout=60, message=worker.log_tail)
    for key, entries in found.items():
        expected = []
        for index in range(5):
            task_id = ids[key, index]
            expected += [f"start {task_id}"] * (2 if index % 3 == 1 else 1) + [f"end {task_id}"]
        assert entries == expected, key


def log_of(client: redis.Redis, prefix: str, log: str) -> list[str]:
    return [e.decode() for e in client.lrange(f"{prefix}:mx:log:{log}", 0, -1)]


def celery_cli(redis_url: str, prefix: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.limits_app", "envelope", *args],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TEST_BROKER_URL": envelope_url(redis_url),
             "TEST_RESULT_BACKEND": redis_url, "TEST_KEY_PREFIX": prefix,
             "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)])})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_halted_key_waits_for_an_operator_who_skips_its_dead_head(
        worker: CeleryWorker, app: Celery, redis_client: redis.Redis, redis_url: str,
        prefix: str) -> None:
    # Given the setting's policy (halt) and a key whose head fails for good
    log = f"{prefix}-halt"
    doomed = app.send_task("ordering.step", kwargs={"log": log, "fail": True},
                           queue=CELERY_QUEUE, headers={"ordering_key": "halting"}).id
    after = app.send_task("ordering.step", kwargs={"log": log}, queue=CELERY_QUEUE,
                          headers={"ordering_key": "halting"}).id

    # Then it is dead-lettered (by the worker: acknowledged early) and the key halts
    shown = wait_for(lambda: (lambda s: s if doomed in s else None)(celery_cli(
        redis_url, prefix, "ordering", "show", "-Q", CELERY_QUEUE, "--key", "halting")),
        timeout=20, message=worker.log_tail)
    (line,) = [line for line in shown.splitlines() if line.startswith("halting")]
    assert line.split() == ["halting", doomed, "1", doomed], shown  # head, waiting, halted for
    time.sleep(1)
    assert log_of(redis_client, prefix, log) == [f"start {doomed}"]

    # When an operator skips the head, the next task runs
    assert f"skipped {doomed}" in celery_cli(redis_url, prefix, "ordering", "skip", "halting",
                                             "-Q", CELERY_QUEUE)
    wait_for(lambda: log_of(redis_client, prefix, log)[-1:] == [f"end {after}"], timeout=20,
             message=worker.log_tail)
    shown = json.loads(celery_cli(redis_url, prefix, "ordering", "show", "-Q", CELERY_QUEUE,
                                  "--json"))
    assert shown["policies"] == {"ordering.step": "halt"}
    assert "halting" not in [k["key"] for k in shown["keys"]]
