"""WriteBehind: transactions sent without waiting, replies read by a settle (or once
MAX_UNREAD writes wait for theirs)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kombu_envelope.store.packing import pack_commands
from kombu_envelope.store.write_behind import MAX_UNREAD, WriteBehind
from kombu_envelope.testing.redis_server import PrivateRedisServer


@pytest.fixture
def server() -> Iterator[PrivateRedisServer]:
    """A Redis of the test's own: the tests pause it and kill its clients."""
    with PrivateRedisServer() as private:
        yield private


def _incr(client: redis.Redis, key: str) -> redis.client.Pipeline:
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, "state", "running")
    pipe.hincrby(key, "attempts", 1)
    return pipe


def _held(client: redis.Redis) -> int:
    """How many connections of the client's pool are taken (the writer keeps one)."""
    return len(client.connection_pool._in_use_connections)  # type: ignore[attr-defined]


def test_a_write_is_sent_without_waiting_and_has_landed_once_settled(
        server: PrivateRedisServer) -> None:
    client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    behind = WriteBehind(client)
    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    failures: list[BaseException] = []
    behind.send(_incr(client, "record"), redo=lambda: failures.append(AssertionError("redo")),
                failed=failures.append)
    # It returned while Redis holds every write: it did not wait for the reply.
    assert control.exists("record") == 0
    control.execute_command("CLIENT", "UNPAUSE")
    behind.settle()
    assert control.hgetall("record") == {b"state": b"running", b"attempts": b"1"}
    assert failures == [] and _held(client) == 1


def test_writes_go_on_the_writer_s_connection_and_at_most_max_unread_wait_unread(
        server: PrivateRedisServer) -> None:
    client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    behind = WriteBehind(client)
    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    for _ in range(MAX_UNREAD):  # none waits for Redis, which holds every write
        behind.send(_incr(client, "record"), redo=pytest.fail, failed=pytest.fail)
    unpause = threading.Timer(0.3, control.execute_command, ("CLIENT", "UNPAUSE"))
    unpause.start()
    began = time.monotonic()
    behind.send(_incr(client, "record"), redo=pytest.fail, failed=pytest.fail)
    waited = time.monotonic() - began
    unpause.join()
    assert waited >= 0.25  # the next one read the replies of those before it first
    behind.settle()
    assert client.hget("record", "attempts") == str(MAX_UNREAD + 1).encode()
    # The writer's connection for the writes, and another one for the read.
    assert _held(client) == 1 and len(client.connection_pool._available_connections) == 1


def test_an_error_reply_goes_to_failed_and_the_connection_stays_usable(
        server: PrivateRedisServer) -> None:
    client = redis.Redis.from_url(server.url)
    client.set("text", "v")
    behind, failures = WriteBehind(client), []
    pipe = client.pipeline(transaction=True)
    pipe.hset("text", "f", "v")  # WRONGTYPE inside EXEC
    pipe.set("after", "1")
    behind.send(pipe, redo=pytest.fail, failed=failures.append)
    behind.send(_incr(client, "record"), redo=pytest.fail, failed=failures.append)
    behind.settle()
    assert [type(error) for error in failures] == [redis.ResponseError]
    assert "WRONGTYPE" in str(failures[0])
    assert client.get("after") == b"1" and client.hget("record", "attempts") == b"1"


def test_writes_lost_with_their_connection_are_redone_in_order_before_the_next(
        server: PrivateRedisServer) -> None:
    client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    behind, done = WriteBehind(client), []

    def redo(name: str, pipe: redis.client.Pipeline) -> None:
        done.append(name)
        pipe.execute()

    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    first = _incr(client, "first")
    behind.send(first, redo=lambda: redo("first", first), failed=pytest.fail)
    # Killed while Redis held its write: it never ran.
    control.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    control.execute_command("CLIENT", "UNPAUSE")
    second = _incr(client, "second")
    behind.send(second, redo=lambda: redo("second", second), failed=pytest.fail)
    behind.settle()
    assert done == ["first", "second"]  # both redone, in the order they were sent
    assert control.hget("first", "attempts") == b"1" and control.hget("second",
                                                                      "attempts") == b"1"
    assert _held(client) == 0  # the lost connection went back, and the redos are in the pool


def test_a_send_on_a_lost_connection_redoes_the_unread_writes_first(
        server: PrivateRedisServer) -> None:
    client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    behind, done = WriteBehind(client), []

    def send(name: str) -> None:
        pipe = _incr(client, name)

        def redo() -> None:
            done.append(name)
            pipe.execute()

        behind.send(pipe, redo=redo, failed=pytest.fail)

    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    send("first")
    control.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    control.execute_command("CLIENT", "UNPAUSE")
    send("second")  # into the closed connection, or refused there
    time.sleep(0.1)  # the peer's reset has come back
    send("third")  # refused: what was sent unread before it is written again first
    behind.settle()
    assert done[:2] == ["first", "second"]
    assert [control.hget(key, "attempts") for key in ("first", "second", "third")] == [b"1"] * 3


def test_a_write_that_cannot_be_sent_is_redone_at_once(server: PrivateRedisServer) -> None:
    client = redis.Redis.from_url(server.url)
    server.stop()
    behind, done = WriteBehind(client), []
    behind.send(_incr(client, "record"), redo=lambda: done.append("redo"), failed=pytest.fail)
    assert done == ["redo"] and _held(client) == 0


class _Interrupted(Exception):
    """What a signal handler raises in the middle of a read (a soft time limit does)."""


def test_a_read_interrupted_by_a_signal_is_redone_at_the_next_settle(
        server: PrivateRedisServer) -> None:
    client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
    behind, done = WriteBehind(client), []
    pipe = _incr(client, "record")
    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    behind.send(pipe, redo=lambda: done.append(pipe.execute()), failed=pytest.fail)

    def interrupt(_signum: int, _frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupted):
            behind.settle()  # blocked on the reply that the pause holds back
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    control.execute_command("CLIENT", "UNPAUSE")
    behind.settle()  # the connection is out of step: dropped, and the write redone
    assert len(done) == 1
    assert control.hget("record", "attempts") == b"1"  # its connection closed, unrun
    behind.send(_incr(client, "after"), redo=pytest.fail, failed=pytest.fail)
    behind.settle()
    assert control.hget("after", "attempts") == b"1"  # the writer goes on in step


@pytest.mark.parametrize("commands", [
    [("MULTI",), ("HSET", "k", "state", "running", "attempt", 1, "ratio", 0.5),
     ("PEXPIRE", "k", 86_400_000), ("EXEC",)],
    [("MULTI",), ("SET", b"k", memoryview(b"v\xff")), ("EXEC",)],
    [("MULTI",), ("SET", "k", bytearray(b"v")), ("EXEC",)],  # hiredis refuses bytearray
    [("MULTI",), ("CLIENT SETNAME", "worker"), ("EXEC",)],  # a command named in two words
    [("SET", "k", "\u00e9t\u00e9")],
])
def test_a_transaction_is_packed_as_redis_py_packs_it(commands: list[tuple[Any, ...]]) -> None:
    connection = redis.Redis().connection_pool.make_connection()  # packs; never connects
    assert b"".join(pack_commands(connection, commands)) == b"".join(
        connection.pack_commands(commands))


def test_a_value_redis_cannot_take_is_reported_by_redis_py() -> None:
    connection = redis.Redis().connection_pool.make_connection()
    with pytest.raises(redis.DataError):
        pack_commands(connection, [("MULTI",), ("SET", "k", None), ("EXEC",)])
