"""Acks that wait for the next deliveries, and the success record that rides on the ack
of its entry (docs/protocol.md, sections 5 and 14), against a real Redis."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import redis

from kombu_envelope import Envelope
from kombu_envelope.keys import bucket_for
from kombu_envelope.kombu.delivery_info import (
    INFO_ENTRY_ID,
    INFO_SLOT,
    INFO_STREAM,
    INFO_TASK_ID,
)
from kombu_envelope.kombu.settle import Settler, record_with_ack
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.queues import Queues
from kombu_envelope.store.task_records import TaskRecords, TaskState, record_write
from kombu_envelope.store.worker_stats import process_buffer, read_stats
from kombu_envelope.testing.redis_server import PrivateRedisServer

QUEUE = "settled"
CONSUMER = "settle-test-consumer"


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


def read_one(client: redis.Redis, settings: Settings) -> dict[str, str]:
    """Publish a task and read it as CONSUMER: the delivery_info of its pending entry."""
    Queues(client, settings).declare(QUEUE)
    envelope = Envelope.new(task_type="orders.close", payload={"order_id": 7})
    stream = settings.keys.queue(QUEUE).stream(bucket_for(envelope.priority))
    entry_id = Publisher(client, settings).publish(QUEUE, envelope)
    assert entry_id is not None
    client.xreadgroup(settings.consumer_group, CONSUMER, {stream: ">"})
    return {INFO_STREAM: stream, INFO_ENTRY_ID: entry_id, INFO_TASK_ID: envelope.task_id}


def settler(client: redis.Redis, settings: Settings, held: set[str]) -> Settler:
    found = Settler(client, settings, CONSUMER, lambda _stream: QUEUE, held.__contains__)
    found.defer_acks = True  # as under an event loop
    return found


def success(settings: Settings, info: dict[str, str]) -> object:
    return record_write(settings, QUEUE, info[INFO_TASK_ID], TaskState.SUCCEEDED)


def pending(client: redis.Redis, settings: Settings, info: dict[str, str]) -> int:
    return int(client.xpending(info[INFO_STREAM], settings.consumer_group)["pending"])


def state(client: redis.Redis, settings: Settings, info: dict[str, str]) -> TaskState:
    return TaskRecords(client, settings).get(info[INFO_TASK_ID], QUEUE).state


def test_a_success_rides_on_the_waiting_ack_with_the_statistics(
        redis_client: redis.Redis, settings: Settings) -> None:
    info = read_one(redis_client, settings)
    acks = settler(redis_client, settings, set())
    acks.ack(info)
    assert pending(redis_client, settings, info) == 1  # the ack waits for the next ones
    assert record_with_ack(CONSUMER, info[INFO_STREAM], info[INFO_ENTRY_ID],
                           success(settings, info))
    process_buffer(settings).count(QUEUE, "orders.close", "succeeded")
    assert state(redis_client, settings, info) is TaskState.QUEUED
    acks.flush_acks()
    assert pending(redis_client, settings, info) == 0
    assert redis_client.xlen(info[INFO_STREAM]) == 0
    assert state(redis_client, settings, info) is TaskState.SUCCEEDED
    (stats,) = read_stats(redis_client, settings, QUEUE)
    assert stats.counters["succeeded"] == 1


def test_a_success_waits_for_the_ack_to_come_and_a_requeue_drops_it(
        redis_client: redis.Redis, settings: Settings) -> None:
    first, second = read_one(redis_client, settings), read_one(redis_client, settings)
    held = {f"{info[INFO_STREAM]} {info[INFO_ENTRY_ID]}" for info in (first, second)}
    acks = settler(redis_client, settings, held)
    for info in (first, second):  # delivered here, not acknowledged yet
        assert record_with_ack(CONSUMER, info[INFO_STREAM], info[INFO_ENTRY_ID],
                               success(settings, info))
    acks.ack(first)
    acks.requeue(second)
    acks.flush_acks()
    assert state(redis_client, settings, first) is TaskState.SUCCEEDED
    assert state(redis_client, settings, second) is TaskState.QUEUED
    assert pending(redis_client, settings, second) == 0  # put back at the end of its stream
    assert redis_client.xlen(second[INFO_STREAM]) == 1


def test_without_an_ack_to_come_here_the_caller_writes_the_record(
        redis_client: redis.Redis, settings: Settings) -> None:
    info = read_one(redis_client, settings)
    acks = settler(redis_client, settings, set())
    record = success(settings, info)
    assert not record_with_ack("no-such-consumer", info[INFO_STREAM], info[INFO_ENTRY_ID],
                               record)
    # Neither waiting nor still delivered here: the ack went already, or never comes.
    assert not record_with_ack(CONSUMER, info[INFO_STREAM], info[INFO_ENTRY_ID], record)
    acks.ack(info)
    child = os.fork()
    if child == 0:  # a forked pool process must not use its parent's settler
        os._exit(1 if record_with_ack(CONSUMER, info[INFO_STREAM], info[INFO_ENTRY_ID],
                                      record) else 0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    acks.flush_acks()
    assert state(redis_client, settings, info) is TaskState.QUEUED
    assert pending(redis_client, settings, info) == 0


@pytest.fixture
def private() -> Iterator[tuple[redis.Redis, redis.Redis]]:
    """A Redis of the test's own (the tests pause it and kill its clients): the
    settler's client and a control client."""
    with PrivateRedisServer() as server:
        client, control = redis.Redis.from_url(server.url), redis.Redis.from_url(server.url)
        yield client, control
        client.close()
        control.close()


def acked(client: redis.Redis, settings: Settings, *infos: dict[str, str]) -> Settler:
    """A settler under an event loop that acknowledged ``infos`` (not flushed yet)."""
    acks = settler(client, settings, set())
    for info in infos:
        acks.ack(info)
    return acks


def test_an_event_loop_s_acks_go_without_waiting_and_land_once_settled(
        private: tuple[redis.Redis, redis.Redis], settings: Settings) -> None:
    client, control = private
    first, second = read_one(client, settings), read_one(client, settings)
    acks = acked(client, settings, first, second)
    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    acks.flush_acks(wait=False)  # returns while Redis holds every write
    assert pending(control, settings, first) == 2
    control.execute_command("CLIENT", "UNPAUSE")
    acks.settle_acks()
    assert pending(control, settings, first) == 0 and control.xlen(first[INFO_STREAM]) == 0


def flush_and_lose(acks: Settler, control: redis.Redis) -> None:
    """Send the acks without waiting, then lose their connection before Redis ran them."""
    control.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    acks.flush_acks(wait=False)
    control.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    control.execute_command("CLIENT", "UNPAUSE")  # the acks never ran


def test_an_ack_lost_with_its_connection_is_written_again_when_settled(
        private: tuple[redis.Redis, redis.Redis], settings: Settings) -> None:
    client, control = private
    info = read_one(client, settings)
    acks = acked(client, settings, info)
    flush_and_lose(acks, control)
    assert pending(control, settings, info) == 1
    acks.settle_acks()
    assert pending(control, settings, info) == 0 and control.xlen(info[INFO_STREAM]) == 0


def test_giving_back_what_the_consumer_holds_first_writes_again_a_lost_ack(
        private: tuple[redis.Redis, redis.Redis], settings: Settings) -> None:
    client, control = private
    done, held = read_one(client, settings), read_one(client, settings)
    acks = acked(client, settings, done)
    flush_and_lose(acks, control)
    acks.requeue_own_pending([QUEUE])
    # Only the entry not acknowledged went back (as a new entry): the other one ran.
    stream = done[INFO_STREAM]
    assert pending(control, settings, done) == 0 and control.xlen(stream) == 1
    (entry_id, _fields), = control.xrange(stream)
    assert entry_id.decode() not in (done[INFO_ENTRY_ID], held[INFO_ENTRY_ID])


def test_acks_that_free_a_slot_wait_for_their_reply(
        private: tuple[redis.Redis, redis.Redis], settings: Settings) -> None:
    client, control = private
    info = read_one(client, settings)
    acks = settler(client, settings, set())
    running = settings.keys.queue(QUEUE).base + ":running:orders.close"
    member = f"{info[INFO_STREAM]} {info[INFO_ENTRY_ID]}"
    control.zadd(running, {member: 1})
    acks.ack({**info, INFO_SLOT: running})
    control.execute_command("CLIENT", "PAUSE", 300, "WRITE")  # lifts itself
    began = time.monotonic()
    acks.flush_acks(wait=False)  # its readers are woken once it landed: it waits
    assert time.monotonic() - began >= 0.25
    assert pending(control, settings, info) == 0 and control.zscore(running, member) is None
