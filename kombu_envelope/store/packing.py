"""Transactions on one Redis written in one go: packed by hiredis, replies read as sent.

redis-py packs each command of a pipeline with ``hiredis.pack_command`` when hiredis is
installed, but first encodes every argument in Python and then copies the bytes into
chunks: for a task record's ``MULTI`` that costs four times the packing itself (11
against 2.7 µs). The worker's writes that wait for their replies
(:func:`~kombu_envelope.store.replication.execute`) and those that do not
(:mod:`~kombu_envelope.store.write_behind`) pack their transactions here instead.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    from hiredis import pack_command

try:  # redis-py's hiredis parser, whose reader the replies are taken from at once
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout: read one by one
    _HiredisParser = None

__all__ = ["exec_transaction", "first_error", "pack_commands", "read_replies",
           "read_reply", "transaction_commands"]


def transaction_commands(pipe: Any) -> list[tuple[Any, ...]]:
    """The commands queued on ``pipe`` (a redis-py pipeline), as one ``MULTI`` ... ``EXEC``."""
    return [("MULTI",), *(args for args, _ in pipe.command_stack), ("EXEC",)]


def pack_commands(connection: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """The chunks of bytes of ``commands`` for ``send_packed_command``, the same bytes as
    ``connection.pack_commands`` makes.

    Commands named in one word are packed with hiredis directly. Others, and a value
    hiredis refuses (which redis-py then converts or reports), go to redis-py.
    """
    if HIREDIS_AVAILABLE and all(type(args[0]) is str and " " not in args[0]
                                 for args in commands):
        try:
            return [b"".join([pack_command(args) for args in commands])]
        except TypeError:
            pass
    packed: list[bytes] = connection.pack_commands(commands)
    return packed


def read_reply(connection: Any) -> Any:
    """One reply; an error reply is returned, not raised, so that the rest are read."""
    try:
        return connection.read_response()
    except ResponseError as exc:
        return exc


def read_replies(connection: Any, count: int) -> list[Any]:
    """``count`` replies, errors returned as :func:`read_reply` returns them.

    On a RESP2 connection with redis-py's hiredis parser they are taken from its reader as
    they come, reading the socket when it has no whole reply: redis-py's
    ``read_response`` costs about half a microsecond more per reply, eight times per
    task record. A lost or broken connection is disconnected and raised as
    :class:`redis.ConnectionError` (or redis-py's ``TimeoutError``), as ``read_response``
    raises it.
    """
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if (_HiredisParser is None or type(parser) is not _HiredisParser or reader is None
            or connection.protocol in (3, "3")):
        return [read_reply(connection) for _ in range(count)]
    replies: list[Any] = []
    try:
        while len(replies) < count:
            reply = reader.gets()
            if reply is NOT_ENOUGH_DATA:
                parser.read_from_socket()
            elif isinstance(reply, RedisConnectionError):  # LOADING, say: raised as redis-py does
                raise reply
            else:
                replies.append(reply)
    except RedisError:
        connection.disconnect()
        raise
    except OSError as exc:
        connection.disconnect()
        raise RedisConnectionError(f"Error while reading a reply: {exc!r}") from exc
    return replies


def first_error(replies: list[Any]) -> BaseException | None:
    """The first error among a transaction's replies (``EXEC``'s nested ones included)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            return reply
        if isinstance(reply, list):
            nested = first_error(reply)
            if nested is not None:
                return nested
    return None


def exec_transaction(pipe: Any) -> list[Any]:
    """Run the commands queued on ``pipe`` (a redis-py ``MULTI`` pipeline on one Redis, not
    executed) and return ``EXEC``'s replies as Redis sent them (integers, byte strings and
    lists, no response callbacks); the pipeline is reset.

    Written and read on one connection of the pipeline's pool, with the connection's
    retry on a lost connection or an outage, as redis-py's pipeline does; the first error
    reply is raised once every reply is read.
    """
    commands = transaction_commands(pipe)
    pool = pipe.connection_pool
    connection = pool.get_connection()
    try:
        return connection.retry.call_with_retry(  # type: ignore[no-any-return]
            lambda: _exchange(connection, commands), lambda _error: connection.disconnect())
    finally:
        pool.release(connection)
        pipe.reset()


def _exchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    connection.send_packed_command(pack_commands(connection, commands))
    replies = read_replies(connection, len(commands))
    error = first_error(replies)
    if error is not None:
        raise error
    return list(replies[-1])
