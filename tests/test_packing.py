"""Transactions on one Redis written in one go (kombu_envelope.store.packing)."""

from __future__ import annotations

import pytest
import redis

from kombu_envelope.settings import Settings
from kombu_envelope.store.packing import (
    exec_transaction,
    pack_commands,
    read_replies,
    read_reply,
)
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


def test_replies_read_at_once_are_those_read_one_by_one(
        redis_client: redis.Redis, key_prefix: str) -> None:
    big = "x" * 200_000  # several reads of the socket for one reply
    redis_client.set(f"{key_prefix}:text", "v")
    commands = [("MULTI",), ("SET", f"{key_prefix}:big", big),
                ("HSET", f"{key_prefix}:text", "f", "v"), ("INCRBY", f"{key_prefix}:n", 2),
                ("EXEC",), ("GET", f"{key_prefix}:big"), ("NOT-A-COMMAND",)]
    connection = redis_client.connection_pool.get_connection()
    assert type(connection._parser).__name__ == "_HiredisParser"  # the path read at once
    try:
        answers = []
        for read in (lambda: read_replies(connection, len(commands)),
                     lambda: [read_reply(connection) for _ in commands]):
            connection.send_packed_command(pack_commands(connection, commands))
            answers.append(read())
        at_once, one_by_one = answers
        assert [type(reply) for reply in at_once] == [type(reply) for reply in one_by_one]
        assert at_once[:4] == one_by_one[:4] == [b"OK", b"QUEUED", b"QUEUED", b"QUEUED"]
        (set_ok, wrongtype, counted), got, unknown = at_once[4], at_once[5], at_once[6]
        assert set_ok == b"OK" and counted == 2 and got == big.encode()
        assert isinstance(wrongtype, redis.ResponseError) and "WRONGTYPE" in str(wrongtype)
        assert isinstance(unknown, redis.ResponseError) and "unknown command" in str(unknown)
        assert one_by_one[4][2] == 4  # the second run of the transaction
        connection.send_command("PING")
        assert connection.read_response() == b"PONG"  # in step after both
    finally:
        redis_client.connection_pool.release(connection)


def test_a_connection_lost_while_replies_are_read_is_raised_and_dropped() -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        connection = client.connection_pool.get_connection()
        kill_all = [("CLIENT", "KILL", "SKIPME", "no")]  # this connection with the others
        connection.send_packed_command(pack_commands(connection, kill_all))
        with pytest.raises(redis.ConnectionError):
            read_replies(connection, 2)  # the kill's reply never comes
        assert connection._sock is None  # disconnected: the next command reconnects
        connection.send_command("PING")
        assert connection.read_response() == b"PONG"
        client.connection_pool.release(connection)
        client.close()
