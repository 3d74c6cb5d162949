"""Batch on one Redis: steps written on a pool connection, replies read in order."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import redis
from support.connection_loss import connection_lost_after_flushes

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import PRIORITY_DEFAULT, Envelope, utcnow
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.publisher import FLUSH_EVERY, Publisher
from kombu_envelope.testing.redis_server import PrivateRedisServer


def test_commands_answer_in_order_after_the_first_steps(
        redis_client: redis.Redis, key_prefix: str) -> None:
    batch = Batch(redis_client).first("sadd", f"{key_prefix}:set", "a")
    batch.command("hset", f"{key_prefix}:hash", "x", "1")
    batch.command("hgetall", f"{key_prefix}:hash")
    batch.command("sismember", f"{key_prefix}:set", "a")
    assert batch.execute() == [1, {b"x": b"1"}, 1]  # hgetall's reply through its callback


def test_scripts_of_due_and_delayed_tasks_answer_in_order(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    due, later = Envelope.new(task_type="order.close"), Envelope.new(
        task_type="order.close", schedule_time=utcnow() + timedelta(hours=1))
    ids = Publisher(redis_client, settings).publish_many([("q", due), ("q", later), ("q", due)])
    keys = settings.keys.queue("q")
    assert ids[1] is None and ids[0] == ids[2]  # the same task again: stored once
    assert [entry_id.decode() for entry_id, _ in redis_client.xrange(
        keys.stream(bucket_for(PRIORITY_DEFAULT)))] == [ids[0]]
    assert redis_client.zscore(keys.delayed, later.task_id) == later.due_ms()
    assert redis_client.sismember(settings.keys.queues, "q")


def test_an_error_reply_is_raised_once_every_reply_is_read(
        redis_client: redis.Redis, key_prefix: str) -> None:
    redis_client.set(f"{key_prefix}:text", "v")
    batch = Batch(redis_client).command("hset", f"{key_prefix}:text", "f", "v")
    batch.command("set", f"{key_prefix}:after", "1")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        batch.execute()
    assert redis_client.get(f"{key_prefix}:after") == b"1"
    assert redis_client.ping()  # the connection went back to the pool in step


def test_a_redis_that_lost_its_scripts_gets_them_again() -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        publisher = Publisher(client)
        publisher.publish_many([("q", Envelope.new(task_type="order.close")) for _ in range(2)])
        client.script_flush()
        ids = publisher.publish_many([("q", Envelope.new(task_type="order.close"))
                                      for _ in range(2)])
        stream = Settings().keys.queue("q").stream(bucket_for(PRIORITY_DEFAULT))
        assert [entry_id for entry_id, _ in client.xrange(stream)][2:] == [
            entry_id.encode() for entry_id in ids if entry_id]
        client.close()


def test_calls_a_redis_answered_noscript_are_sent_again_whole_with_their_own_wait() -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        settings = Settings(wait_replicas=1, wait_timeout_ms=10)  # no replica: a short WAIT
        publisher = Publisher(client, settings)
        publisher.publish_many([("q", Envelope.new(task_type="order.close")) for _ in range(2)])
        client.script_flush()
        later = Envelope.new(task_type="order.close", schedule_time=utcnow() + timedelta(hours=1))
        due = Envelope.new(task_type="order.close", payload={"n": 1})
        ids = publisher.publish_many([("q", due), ("q", later)])
        keys = settings.keys.queue("q")
        [(entry_id, fields)] = client.xrange(keys.stream(bucket_for(PRIORITY_DEFAULT)))[2:]
        assert ids == [entry_id.decode(), None]
        assert decode_entry(fields) == due
        assert client.zscore(keys.delayed, later.task_id) == later.due_ms()
        assert client.hget(keys.task_record(due.task_id), "state") == b"queued"
        client.close()


def test_small_and_large_bodies_of_one_batch_arrive_whole(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix, gzip_min_bytes=None)
    envelopes = [Envelope.new(task_type="order.close", payload={"blob": os.urandom(n).hex()})
                 for n in (10, 70_000, 10, 40_000, 40_000, 10)]
    Publisher(redis_client, settings).publish_many([("q", envelope) for envelope in envelopes])
    stream = settings.keys.queue("q").stream(bucket_for(PRIORITY_DEFAULT))
    assert [decode_entry(fields) for _, fields in redis_client.xrange(stream)] == envelopes


def test_flushed_steps_run_while_the_rest_is_queued_and_every_reply_comes_in_order(
        redis_client: redis.Redis, key_prefix: str) -> None:
    batch = Batch(redis_client).first("sadd", f"{key_prefix}:set", "a")
    batch.command("set", f"{key_prefix}:early", "1")
    batch.flush()
    deadline = time.monotonic() + 5
    while not redis_client.exists(f"{key_prefix}:early"):  # run before execute() is called
        assert time.monotonic() < deadline, "the flushed steps did not run"
        time.sleep(0.01)
    batch.command("get", f"{key_prefix}:early")
    batch.flush()
    batch.command("sismember", f"{key_prefix}:set", "a")
    assert batch.execute() == [True, b"1", 1]


def test_a_connection_lost_after_a_flush_has_every_step_sent_again_and_stored_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        envelopes = [Envelope.new(task_type="order.close") for _ in range(FLUSH_EVERY * 3 + 7)]
        with connection_lost_after_flushes(monkeypatch, server.url, 1) as killed:
            ids = Publisher(client).publish_many([("q", envelope) for envelope in envelopes])
        assert killed == [1]
        stream = Settings().keys.queue("q").stream(bucket_for(PRIORITY_DEFAULT))
        stored = client.xrange(stream)
        assert [entry_id.decode() for entry_id, _ in stored] == ids  # the repeats stored nothing
        assert [decode_entry(fields).task_id for _, fields in stored] == [
            envelope.task_id for envelope in envelopes]
        client.close()


def test_a_flushed_batch_given_up_gives_its_connection_back(redis_url: str,
                                                             key_prefix: str) -> None:
    pool = redis.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=2)
    client = redis.Redis(connection_pool=pool)
    batch = Batch(client).command("set", f"{key_prefix}:given-up", "1")
    batch.flush()
    batch.close()
    assert client.ping()  # the pool's one connection is back, its unread reply dropped
    assert client.get(f"{key_prefix}:given-up") == b"1"
    client.close()


def test_a_flush_while_redis_is_down_leaves_the_steps_to_execute() -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        batch = Batch(client).command("set", "flushed", "1")
        server.stop()
        batch.flush()  # refused: nothing written, nothing raised
        server.start()
        batch.command("get", "flushed")
        assert batch.execute() == [True, b"1"]
        client.close()
