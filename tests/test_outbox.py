"""The transactional outbox against a real PostgreSQL and SQLite, and a real Redis.

PostgreSQL comes from Debian's binaries (tests/support/postgres.py), started once for
the module. Relays run in this process or as subprocesses (SIGKILL, races).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, delete, event, func, select
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from celery_ext.outbox import outbox
from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.keys import BUCKETS_BY_URGENCY
from kombu_envelope.outbox import OutboxWriter, Relay, divert_to, outbox_engine
from kombu_envelope.outbox.table import metadata, outbox_table
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher
from tests.support.celery_outbox import outbox_app  # imports celery_ext before any envelope://
from tests.support.envelope_streams import connect, envelope_url
from tests.support.postgres import PrivatePostgres

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "outbox"


@pytest.fixture(scope="module")
def postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'outbox.db'}"
    url: str = request.getfixturevalue("postgres").url
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = outbox_engine(db_url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(delete(outbox_table))  # PostgreSQL's table is shared by the module
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def relay(engine: Engine, redis_client: redis.Redis, settings: Settings) -> Relay:
    return Relay(engine, Publisher(redis_client, settings), idle_s=0.05)


def task(n: int) -> Envelope:
    return Envelope.new(task_type="order.placed", payload={"n": n})


def write(engine: Engine, settings: Settings, envelopes: list[Envelope]) -> None:
    with Session(engine) as session, session.begin():
        writer = OutboxWriter(session, settings)
        for envelope in envelopes:
            writer.write(QUEUE, envelope)


def stream_task_ids(client: redis.Redis, settings: Settings) -> Counter[str]:
    keys = settings.keys.queue(QUEUE)
    return Counter(decode_entry(fields).task_id
                   for bucket in BUCKETS_BY_URGENCY
                   for _, fields in client.xrange(keys.stream(bucket)))


def waiting(engine: Engine) -> int:
    with engine.connect() as conn:
        count: int = conn.execute(select(func.count()).select_from(outbox_table)).scalar_one()
        return count


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_committed_task_is_published_once(engine: Engine, relay: Relay,
                                            redis_client: redis.Redis,
                                            settings: Settings) -> None:
    envelopes = [task(n) for n in range(3)]
    write(engine, settings, envelopes)
    assert relay.lag().waiting == 3
    assert relay.relay_batch() == 3
    assert relay.relay_batch() == 0
    assert stream_task_ids(redis_client, settings) == {e.task_id: 1 for e in envelopes}
    assert waiting(engine) == 0
    assert relay.lag().oldest_age_s == 0.0


def test_a_rolled_back_task_publishes_nothing(engine: Engine, relay: Relay,
                                              redis_client: redis.Redis,
                                              settings: Settings) -> None:
    with Session(engine) as session, pytest.raises(RuntimeError), session.begin():
        OutboxWriter(session, settings).write(QUEUE, task(1))
        session.flush()
        raise RuntimeError("the request failed")
    assert relay.relay_batch() == 0
    assert stream_task_ids(redis_client, settings) == {}


def test_an_invalid_task_fails_when_written(engine: Engine, settings: Settings) -> None:
    far = Envelope.new(task_type="t", schedule_time="2999-01-01T00:00:00Z")
    with Session(engine) as session, session.begin(), pytest.raises(InvalidEnvelope) as caught:
        OutboxWriter(session, settings).write(QUEUE, far)
    assert caught.value.rules == ["max_delay"] and caught.value.fields == ["schedule_time"]
    assert waiting(engine) == 0


def test_a_row_that_breaks_a_schema_since_is_dead_lettered(
        engine: Engine, relay: Relay, redis_client: redis.Redis, settings: Settings) -> None:
    good, bad = task(1), Envelope.new(task_type="order.placed", payload={"n": "x"})
    write(engine, settings, [good, bad])
    relay.publisher.schemas.register("order.placed", 1, {
        "type": "object", "properties": {"n": {"type": "integer"}}})
    assert relay.relay_batch() == 2
    assert stream_task_ids(redis_client, settings) == {good.task_id: 1}
    dead = redis_client.xrange(settings.keys.queue(QUEUE).dead)
    assert [fields[b"task_id"].decode() for _, fields in dead] == [bad.task_id]
    assert dead[0][1][b"failure_class"] == b"invalid_payload"
    assert waiting(engine) == 0


def test_a_relay_dying_after_dead_lettering_a_row_leaves_one_dead_letter(
        engine: Engine, relay: Relay, redis_client: redis.Redis, settings: Settings) -> None:
    """Dead-lettered, then the row's DELETE fails (the relay dies before it commits): the
    next batch deletes the row and writes no second dead letter, for a row that breaks a
    schema and for one that is not an Envelope."""
    bad = Envelope.new(task_type="order.placed", payload={"n": "x"})
    write(engine, settings, [bad])
    with engine.begin() as conn:
        conn.execute(outbox_table.insert().values(queue=QUEUE, task_id="broken",
                                                  envelope="{not json",
                                                  created_at=datetime.now(timezone.utc)))
    relay.publisher.schemas.register("order.placed", 1, {
        "type": "object", "properties": {"n": {"type": "integer"}}})

    def die_on_delete(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            raise RuntimeError("the relay died before its commit")

    event.listen(engine, "before_cursor_execute", die_on_delete)
    with pytest.raises(RuntimeError, match="died"):
        relay.relay_batch()
    event.remove(engine, "before_cursor_execute", die_on_delete)
    assert waiting(engine) == 2
    assert relay.relay_batch() == 2
    dead = redis_client.xrange(settings.keys.queue(QUEUE).dead)
    assert sorted(fields[b"failure_class"].decode() for _, fields in dead) == [
        "invalid_payload", "malformed_entry"]
    assert waiting(engine) == 0


def test_tasks_published_through_the_channel_are_diverted(
        engine: Engine, relay: Relay, redis_url: str, redis_client: redis.Redis,
        settings: Settings, key_prefix: str) -> None:
    with connect(redis_url, key_prefix) as conn:
        producer = conn.Producer()
        with Session(engine) as session, session.begin(), \
                divert_to(OutboxWriter(session, settings)):
            producer.publish({"task_type": "order.placed", "payload": {"n": 1}},
                             serializer="envelope", routing_key=QUEUE,
                             declare=[conn.SimpleQueue(QUEUE).queue])
            assert stream_task_ids(redis_client, settings) == {}
        assert waiting(engine) == 1
    assert relay.relay_batch() == 1
    assert sum(stream_task_ids(redis_client, settings).values()) == 1


def test_a_relay_killed_after_publishing_loses_and_doubles_nothing(
        engine: Engine, db_url: str, relay: Relay, redis_url: str, redis_client: redis.Redis,
        settings: Settings, key_prefix: str, tmp_path: Path) -> None:
    envelopes = [task(n) for n in range(20)]
    write(engine, settings, envelopes)
    marker = tmp_path / "published"
    crashing = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/support/outbox_relay_crash.py"), db_url, redis_url,
         key_prefix, str(marker)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        wait_for(marker.exists)
    finally:
        crashing.send_signal(signal.SIGKILL)
        crashing.wait(10)
    assert marker.read_text() == "20"
    assert waiting(engine) == 20  # published, never deleted
    assert relay.relay_batch() == 20
    assert stream_task_ids(redis_client, settings) == {e.task_id: 1 for e in envelopes}


def test_three_relays_racing_relay_every_row_once(
        engine: Engine, db_url: str, redis_url: str, redis_client: redis.Redis,
        settings: Settings, key_prefix: str) -> None:
    relays = [subprocess.Popen(
        [sys.executable, "-m", "kombu_envelope.outbox", "--db", db_url, "--url", redis_url,
         "--key-prefix", key_prefix, "--batch", "10", "--idle", "0.05"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stderr=subprocess.PIPE, text=True) for _ in range(3)]
    envelopes = [task(n) for n in range(300)]
    try:
        for process in relays:  # each has its signal handlers once it says so
            assert process.stderr is not None
            assert "relaying the outbox" in process.stderr.readline()
        write(engine, settings, envelopes)
        wait_for(lambda: waiting(engine) == 0, timeout=30)
    finally:
        for process in relays:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(10) for process in relays]
    assert codes == [0, 0, 0]
    assert stream_task_ids(redis_client, settings) == {e.task_id: 1 for e in envelopes}


def test_the_celery_relay_command_relays_with_the_apps_broker_and_stops_on_sigterm(
        engine: Engine, db_url: str, redis_url: str, redis_client: redis.Redis,
        settings: Settings, key_prefix: str) -> None:
    """``celery -A proj envelope outbox-relay``: the database from $ENVELOPE_OUTBOX_DB, the
    broker and key prefix from the app."""
    env = {**os.environ, "TEST_BROKER_URL": envelope_url(redis_url),
           "TEST_KEY_PREFIX": key_prefix, "ENVELOPE_OUTBOX_DB": db_url,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), *sys.path]),
           "PYTHONUNBUFFERED": "1"}
    relay = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "apps.envelope_app", "envelope", "outbox-relay",
         "--batch", "5", "--idle", "0.05"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    envelopes = [task(n) for n in range(12)]
    try:
        assert relay.stdout is not None
        assert "relaying the outbox" in relay.stdout.readline()
        write(engine, settings, envelopes)
        wait_for(lambda: waiting(engine) == 0, timeout=30)
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(10)
    assert code == 0
    assert relay.stdout.read().strip() == "outbox relay stopped"
    assert stream_task_ids(redis_client, settings) == {e.task_id: 1 for e in envelopes}


def test_the_relay_goes_on_after_postgresql_restarts(
        postgres: PrivatePostgres, redis_client: redis.Redis, settings: Settings) -> None:
    engine = outbox_engine(postgres.url)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(delete(outbox_table))
    relay = Relay(engine, Publisher(redis_client, settings), idle_s=0.05)
    stop = threading.Event()
    runner = threading.Thread(target=relay.run, args=(stop,))
    runner.start()
    try:
        before, after = task(1), task(2)
        write(engine, settings, [before])
        wait_for(lambda: waiting(engine) == 0)
        postgres.stop()
        time.sleep(0.3)  # the relay meets the outage
        postgres.start()
        write(engine, settings, [after])
        wait_for(lambda: waiting(engine) == 0)
    finally:
        stop.set()
        runner.join(10)
        engine.dispose()
    assert stream_task_ids(redis_client, settings) == {before.task_id: 1, after.task_id: 1}


def test_an_asyncio_session_writes_in_its_transaction(
        tmp_path: Path, redis_client: redis.Redis, settings: Settings) -> None:
    path = tmp_path / "async.db"
    engine = outbox_engine(f"sqlite:///{path}")
    metadata.create_all(engine)
    committed, rolled_back = task(1), task(2)

    async def requests() -> None:
        async_engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
        async with AsyncSession(async_engine) as session:
            async with session.begin():
                OutboxWriter(session, settings).write(QUEUE, committed)
            with pytest.raises(RuntimeError):
                async with session.begin():
                    OutboxWriter(session, settings).write(QUEUE, rolled_back)
                    raise RuntimeError("the request failed")
        await async_engine.dispose()

    asyncio.run(requests())
    relay = Relay(engine, Publisher(redis_client, settings))
    assert relay.relay_batch() == 1
    engine.dispose()
    assert stream_task_ids(redis_client, settings) == {committed.task_id: 1}


def test_celery_delay_inside_the_block_writes_the_outbox(
        engine: Engine, relay: Relay, redis_url: str, redis_client: redis.Redis,
        settings: Settings, key_prefix: str) -> None:
    with outbox_app(redis_url, key_prefix, "sqlalchemy") as (_, placed):
        with Session(engine) as session, session.begin(), outbox(session):
            inside = placed.delay(1)
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin(), \
                outbox(session):
            placed.delay(2)
            raise RuntimeError("the request failed")
        outside = placed.delay(3)  # no outbox block: published as usual
        assert stream_task_ids(redis_client, settings) == {outside.id: 1}
        assert relay.relay_batch() == 1
    ids = stream_task_ids(redis_client, settings)
    assert ids == {outside.id: 1, inside.id: 1}
