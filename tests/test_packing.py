"""Transactions on one Redis written in one go (kombu_envelope.store.packing)."""

from __future__ import annotations

import pytest
import redis

from kombu_envelope.settings import Settings
from kombu_envelope.store.packing import exec_transaction
from kombu_envelope.store.replication import execute, write_pipeline
from kombu_envelope.testing.redis_server import PrivateRedisServer


def test_exec_answers_as_redis_sent_and_the_pipeline_can_be_used_again(
        redis_client: redis.Redis, key_prefix: str) -> None:
    pipe = redis_client.pipeline(transaction=True)
    pipe.hset(f"{key_prefix}:h", mapping={"a": "1", "b": "2"})
    pipe.hexists(f"{key_prefix}:h", "a")
    pipe.incrby(f"{key_prefix}:n", 3)
    replies = exec_transaction(pipe)
    assert replies == [2, 1, 3]
    assert type(replies[1]) is int  # as Redis sent it: redis-py's callback makes it True
    assert pipe.command_stack == []
    pipe.incrby(f"{key_prefix}:n", 1)
    assert exec_transaction(pipe) == [4]


def test_an_error_reply_is_raised_after_the_whole_transaction_ran(
        redis_client: redis.Redis, key_prefix: str) -> None:
    redis_client.set(f"{key_prefix}:text", "v")
    pipe = write_pipeline(redis_client, Settings(), transaction=True)
    pipe.hset(f"{key_prefix}:text", "f", "v")
    pipe.set(f"{key_prefix}:after", "1")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        execute(pipe, Settings(), "test")
    assert redis_client.get(f"{key_prefix}:after") == b"1"
    assert redis_client.ping()  # its connection went back to the pool, in step


def test_a_lost_connection_is_tried_again_and_the_transaction_lands_once() -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        killer = redis.Redis.from_url(server.url)
        client.ping()  # the pool's connection, killed next
        killer.client_kill_filter(_type="normal", skipme=True)
        pipe = client.pipeline(transaction=True)
        pipe.incr("n")
        assert exec_transaction(pipe) == [1]
        assert client.get("n") == b"1"
        client.close()
        killer.close()
