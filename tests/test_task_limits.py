"""Limits per task type in read.lua and the scripts that settle (docs/protocol.md, section 19).

These call the scripts as every SDK does, on the session's real Redis (and watch the plain
transport wait for a slot); the Celery worker and the other languages are in
test_task_limits_celery.py and test_matrix.py.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from kombu import Consumer, Queue
from support.envelope_streams import connect, drain_until
from support.monitor import Commands

from kombu_envelope import Envelope, Publisher
from kombu_envelope.errors import InvalidTaskLimit
from kombu_envelope.keys import Bucket
from kombu_envelope.kombu.delivery_info import INFO_TASK_ID
from kombu_envelope.settings import Settings
from kombu_envelope.store.lease import reclaim_dead_consumers, renew
from kombu_envelope.store.scripts import script
from kombu_envelope.store.slots import free_slot
from kombu_envelope.store.task_limits import Breaker, TaskLimit, TaskLimits

QUEUE = "limited"
GROUP = "workers"
LEASE_MS = 30_000


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix, lease_ms=LEASE_MS)


@pytest.fixture
def streams(client: redis.Redis, settings: Settings) -> list[str]:
    keys = settings.keys.queue(QUEUE)
    for stream in keys.task_streams:
        client.xgroup_create(stream, GROUP, "0", mkstream=True)
    return list(keys.task_streams)


def add(client: redis.Redis, settings: Settings, task_type: str, *,
        bucket: Bucket = Bucket.NORMAL, gzipped: bool = False, t_field: bool = False) -> str:
    body = json.dumps({"task_id": uuid.uuid4().hex, "task_type": task_type}).encode()
    fields: dict[str, Any] = {"v": "1", "enc": "json+gzip" if gzipped else "json",
                              "body": gzip.compress(body) if gzipped else body}
    if t_field:
        fields["t"] = task_type
    return client.xadd(settings.keys.queue(QUEUE).stream(bucket), fields).decode()


def read_all(client: redis.Redis, streams: list[str], consumer: str, count: int = 10,
             capacity: int | None = None,
             lease_ms: int = LEASE_MS) -> tuple[list[str], int, int, str]:
    """(ids handed out, wait_ms, limited, freed_after) of one read.lua call with the
    extra ARGV."""
    args: list[Any] = [GROUP, consumer, count, lease_ms]
    if capacity is not None:
        args.append(capacity)
    reply, wait_ms, limited, freed_after = script(client, "read")(keys=streams, args=args)
    ids = [entry_id.decode() for _s, entries in reply for entry_id, _f in entries]
    return ids, wait_ms, limited, freed_after.decode()


def read(client: redis.Redis, streams: list[str], consumer: str, count: int = 10,
         capacity: int | None = None, lease_ms: int = LEASE_MS) -> tuple[list[str], int, int]:
    """(ids handed out, wait_ms, limited) of one read.lua call with the extra ARGV."""
    return read_all(client, streams, consumer, count, capacity, lease_ms)[:3]


def ack(client: redis.Redis, settings: Settings, stream: str, entry_id: str,
        task_type: str) -> None:
    """A success's acknowledgement, freeing its slot in the same MULTI."""
    pipe = client.pipeline(transaction=True)
    pipe.xack(stream, GROUP, entry_id).xdel(stream, entry_id)
    free_slot(pipe, settings.keys.queue(QUEUE).running(task_type), f"{stream} {entry_id}")
    pipe.execute()


def test_without_the_extra_argv_read_lua_answers_as_before(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    ids = [add(client, settings, "slow") for _ in range(3)]
    reply = script(client, "read")(keys=streams, args=[GROUP, "old", 10])
    assert [e[0].decode() for _s, entries in reply for e in entries] == ids  # no limits


def test_a_queue_without_limits_says_so(client, settings, streams) -> None:
    ids = [add(client, settings, "slow") for _ in range(3)]
    assert read(client, streams, "c1") == (ids, -1, 0)


def test_concurrency_parks_the_rest_and_other_types_flow_past(client, settings,
                                                              streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=2))
    slow = [add(client, settings, "slow") for _ in range(5)]
    fast = [add(client, settings, "fast") for _ in range(3)]
    taken, wait_ms, limited = read(client, streams, "c1")
    assert taken == slow[:2] + fast and limited == 1 and 0 < wait_ms <= 50
    keys = settings.keys.queue(QUEUE)
    stream = keys.stream(Bucket.NORMAL)
    assert client.lrange(keys.parked("slow"), 0, -1) == [f"{stream} {i}".encode()
                                                         for i in slow[2:]]
    pending = {c["name"]: c["pending"] for c in client.xpending(stream, GROUP)["consumers"]}
    assert pending == {b"c1": 5, b"parked": 3}  # parked entries stay in their stream
    assert read(client, streams, "c2")[0] == []  # both slots are held

    ack(client, settings, stream, slow[0], "slow")
    assert read(client, streams, "c2")[0] == [slow[2]]  # the oldest parked one, at once
    later = add(client, settings, "slow")
    ack(client, settings, stream, slow[1], "slow")
    assert read(client, streams, "c2")[0] == [slow[3]]  # behind the parked: publish order
    for entry_id in (slow[2], slow[3]):
        ack(client, settings, stream, entry_id, "slow")
    assert read(client, streams, "c3")[0] == [slow[4], later]
    assert read(client, streams, "c3")[1:] == (-1, 1)  # nothing parked any more
    assert not client.exists(keys.parked("slow"), f"{keys.base}:parked-types")


def test_a_slot_comes_back_after_its_deadline_unless_renewed(client, settings,
                                                             streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    first, second, third = (add(client, settings, "slow") for _ in range(3))
    assert read(client, streams, "gone", lease_ms=300)[0] == [first]  # then never renews
    assert read(client, streams, "live", lease_ms=300)[0] == []
    time.sleep(0.4)
    assert read(client, streams, "live", lease_ms=600)[0] == [second]
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    running = settings.keys.queue(QUEUE).running("slow")
    for _ in range(3):  # the holder renews: its slot outlives the first deadline
        time.sleep(0.3)
        renew(client, Settings(key_prefix=settings.key_prefix, lease_ms=600), ["live"],
              slots=[(running, f"{stream} {second}")])
        assert read(client, streams, "other")[0] == []
    client.zrem(running, f"{stream} {second}")
    renew(client, settings, ["live"], slots=[(running, f"{stream} {second}")])
    assert not client.zscore(running, f"{stream} {second}")  # XX: a freed slot stays freed
    assert read(client, streams, "other")[0] == [third]


def test_a_freed_slot_wakes_the_consumers_waiting_for_one(client, settings, streams,
                                                          redis_url) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    keys = settings.keys.queue(QUEUE)
    stream = keys.stream(Bucket.NORMAL)
    first, second = add(client, settings, "slow"), add(client, settings, "slow")
    fast = add(client, settings, "fast")
    assert read_all(client, streams, "c1", count=1)[3] == ""  # nothing parked yet
    assert not client.exists(keys.slot_freed)
    taken, _wait, _limited, freed_after = read_all(client, streams, "c1")
    assert taken == [fast] and freed_after  # second waits for first's slot
    waiter = redis.Redis.from_url(redis_url)
    assert waiter.xread({keys.slot_freed: freed_after}, block=1) == []  # no slot freed yet
    woken: list[Any] = []
    waiting = threading.Thread(target=lambda: woken.extend(
        waiter.xread({keys.slot_freed: freed_after}, block=10_000)))
    waiting.start()
    time.sleep(0.2)  # blocked by now (were it not, the id still finds the append)
    ack(client, settings, stream, first, "slow")
    waiting.join(15)
    ((_key, [(_id, fields)]),) = woken
    assert fields == {b"t": b"slow"}
    taken, wait_ms, _limited, freed_after = read_all(client, streams, "c2")
    assert (taken, wait_ms, freed_after) == ([second], -1, "")
    assert not client.exists(keys.slot_freed)  # nothing waits: gone
    ack(client, settings, stream, second, "slow")
    assert not client.exists(keys.slot_freed)  # and a free then appends nothing


def test_the_transport_waits_for_a_slot_on_slot_freed(client, redis_url, key_prefix) -> None:
    """A kombu consumer whose task is parked behind another worker's slot has the queue's
    slot-freed stream in its blocking wait (seen with MONITOR), from the id read.lua
    answered, so the settle that frees the slot ends the wait: no timer tick to wait for."""
    settings = Settings(key_prefix=key_prefix)
    TaskLimits(client, settings).set("waits", "slow", TaskLimit(concurrency=1))
    keys = settings.keys.queue("waits")
    running = keys.running("slow")
    client.zadd(running, {"another worker": 2**50})
    task = Envelope.new(task_type="slow", payload={})
    Publisher(client, settings).publish("waits", task)
    got: list[str] = []

    def on_message(_body: Any, message: Any) -> None:
        got.append(message.delivery_info[INFO_TASK_ID])
        message.ack()

    with (Commands(redis_url, lambda c: c.startswith("XREAD ") and keys.slot_freed in c) as waits,
          connect(redis_url, key_prefix) as conn,
          Consumer(conn, [Queue("waits")], callbacks=[on_message])):
        drain_until(conn, lambda: bool(waits.seen))
        ((created, _fields),) = client.xrange(keys.slot_freed)  # by read.lua, parking it
        assert waits.seen[0].split()[-1] == created.decode()
        pipe = client.pipeline(transaction=True)
        free_slot(pipe, running, "another worker")  # as the other worker's settle frees it
        pipe.execute()
        drain_until(conn, lambda: bool(got))
    assert got == [task.task_id]


def test_the_settle_scripts_free_the_slot(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    keys = settings.keys.queue(QUEUE)
    stream, running = keys.stream(Bucket.NORMAL), keys.running("slow")
    for _ in range(4):
        add(client, settings, "slow")
    freed_after = ""

    def held() -> str:
        nonlocal freed_after
        (entry_id,), _wait, _limited, freed_after = read_all(client, streams, "c1")
        assert client.zcard(running) == 1 and freed_after  # the others wait for its slot
        return entry_id

    def freed() -> None:
        assert client.zcard(running) == 0
        ((entry_id, fields),) = client.xrevrange(keys.slot_freed, count=1)
        assert entry_id.decode() != freed_after and fields == {b"t": b"slow"}

    entry_id = held()
    script(client, "dead_letter")(keys=[stream, keys.dead], args=[GROUP, entry_id, "reason", "x"])
    freed()
    entry_id = held()
    script(client, "requeue")(keys=[stream, stream, keys.dead],
                              args=[GROUP, entry_id, "", 0, 0, 0, "2026-01-01T00:00:00Z"])
    freed()
    entry_id = held()
    body = json.dumps({"task_id": "t", "task_type": "slow"})
    script(client, "retry")(keys=[stream, stream, keys.delayed, keys.delayed_data],
                            args=[GROUP, entry_id, "t", 0, "normal", "json", body,
                                  settings.keys.wakeup_channel])
    freed()


def test_a_rate_spaces_starts_and_a_burst_lets_some_through_at_once(client, settings,
                                                                    streams) -> None:
    limits = TaskLimits(client, settings)
    limits.set(QUEUE, "paced", TaskLimit(rate=20))
    limits.set(QUEUE, "bursty", TaskLimit(rate=1, burst=3))
    for _ in range(5):
        add(client, settings, "bursty")
    assert len(read(client, streams, "c1")[0]) == 3  # the burst, then one a second
    for _ in range(10):
        add(client, settings, "paced")
    started, began = [], time.monotonic()
    while len(started) < 10 and time.monotonic() - began < 5:
        taken, wait_ms, _ = read(client, streams, "c1")
        started += [time.monotonic()] * len([i for i in taken])
        time.sleep(max(wait_ms, 1) / 1000)
    assert len(started) >= 10
    span = started[9] - started[0]
    assert 0.40 <= span <= 0.75, span  # 9 intervals of 50 ms


def test_smooth_ignores_the_burst(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "paced", TaskLimit(rate=1, burst=5, smooth=True))
    for _ in range(3):
        add(client, settings, "paced")
    taken, wait_ms, _ = read(client, streams, "c1")
    assert len(taken) == 1 and 900 <= wait_ms <= 1000


def test_no_capacity_parks_limited_entries_only(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=5))
    slow, fast = add(client, settings, "slow"), add(client, settings, "fast")
    taken, wait_ms, _ = read(client, streams, "busy", capacity=0)
    assert taken == [fast] and wait_ms >= 0
    assert not client.zcard(settings.keys.queue(QUEUE).running("slow"))  # no slot held
    assert read(client, streams, "free", capacity=1)[0] == [slow]
    ahead, behind = add(client, settings, "fast"), add(client, settings, "slow")
    assert read(client, streams, "one-free", capacity=1)[0] == [ahead]  # it starts first
    assert read(client, streams, "one-free", capacity=1)[0] == [behind]


def test_a_limit_removed_or_changed_takes_effect_at_the_next_read(client, settings,
                                                                  streams) -> None:
    limits = TaskLimits(client, settings)
    limits.set(QUEUE, "slow", TaskLimit(concurrency=1))
    ids = [add(client, settings, "slow") for _ in range(6)]
    assert read(client, streams, "c1")[0] == ids[:1]
    limits.set(QUEUE, "slow", TaskLimit(concurrency=3))
    assert read(client, streams, "c1")[0] == ids[1:3]
    limits.remove(QUEUE, "slow")
    assert read(client, streams, "c1")[0] == ids[3:]


def test_the_type_comes_from_field_t_else_from_a_plain_body(client, settings,
                                                            streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    first = add(client, settings, "slow", gzipped=True, t_field=True)
    unreadable = add(client, settings, "slow", gzipped=True)
    counted = add(client, settings, "slow", gzipped=True, t_field=True)
    urgent = add(client, settings, "slow", bucket=Bucket.HIGH)
    taken, _, _ = read(client, streams, "c1")
    assert taken == [urgent, unreadable]  # high first; a gzip body without t is not limited
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    assert client.lrange(settings.keys.queue(QUEUE).parked("slow"), 0, -1) == [
        f"{stream} {first}".encode(), f"{stream} {counted}".encode()]  # the high one holds it


@pytest.mark.parametrize("layout", [
    '{{"task_id": "{id}", "task_type" : "{t}", "payload": {{}}}}',
    '{{"payload": {{"task_type": "other"}}, "task_id": "{id}", "task_type": "{t}"}}',
    '{{"payload": {{"note": "\\"task_type\\""}}, "task_type":"{t}", "task_id": "{id}"}}',
], ids=["spaced", "payload-has-the-key", "payload-quotes-it"])
def test_the_type_of_a_plain_body_is_its_own_task_type_whatever_the_layout(
        client, settings, streams, layout: str) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    ids = [client.xadd(stream, {"v": "1", "enc": "json", "body": layout.format(
        id=uuid.uuid4().hex, t=task_type)}).decode() for task_type in ("slow", "slow", "fast")]
    taken, _, _ = read(client, streams, "c1")
    assert taken == [ids[0], ids[2]]  # the second "slow" waits; "fast" has no limit
    assert client.lrange(settings.keys.queue(QUEUE).parked("slow"), 0, -1) == [
        f"{stream} {ids[1]}".encode()]


def test_a_takeover_leaves_parked_entries_alone(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "slow", TaskLimit(concurrency=1))
    ids = [add(client, settings, "slow") for _ in range(3)]
    quick = Settings(key_prefix=settings.key_prefix, lease_ms=60)
    assert read(client, streams, "dead-one")[0] == ids[:1]  # no liveness key: dead
    time.sleep(0.1)
    assert reclaim_dead_consumers(client, quick, QUEUE) == 1  # its entry, not the parked
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    pending = {c["name"]: c["pending"] for c in client.xpending(stream, GROUP)["consumers"]}
    assert pending == {b"parked": 2}
    assert client.xlen(stream) == 3  # the taken-over copy is back at the end
    assert read(client, streams, "c2")[0] == ids[1:2]  # the parked keep their turn


def test_task_limits_round_trip_and_refusals(client, settings) -> None:
    limits = TaskLimits(client, settings)
    limits.set(QUEUE, "emails.send", TaskLimit(rate=10, burst=20))
    limits.set(QUEUE, "billing.charge", TaskLimit(concurrency=50))
    assert limits.get(QUEUE, "emails.send") == TaskLimit(rate=10.0, burst=20)
    assert list(limits.all(QUEUE)) == ["billing.charge", "emails.send"]
    assert client.hget(settings.keys.queue(QUEUE).limits, "billing.charge") == \
        b'{"concurrency":50}'
    assert limits.remove(QUEUE, "emails.send") and not limits.remove(QUEUE, "emails.send")
    assert limits.get(QUEUE, "emails.send") is None
    with pytest.raises(InvalidTaskLimit, match="burst"):
        TaskLimit(rate=1, burst=0)
    with pytest.raises(InvalidTaskLimit, match="task_type"):
        limits.set(QUEUE, "not a type", TaskLimit(concurrency=1))


def outcomes(client: redis.Redis, settings: Settings, language: str, **counts: int) -> None:
    """Counts as a worker of ``language`` writes them (docs/protocol.md, section 17)."""
    for name, count in counts.items():
        client.hincrby(settings.keys.queue(QUEUE).stats, f"flaky {language} {name}", count)


def test_a_breaker_opens_on_failures_lets_a_probe_through_then_closes(client, settings,
                                                                      streams) -> None:
    breaker = Breaker(failure_ratio=0.5, min_attempts=4, window_s=10, cooldown_s=0.5, probes=1)
    limits = TaskLimits(client, settings)
    limits.set(QUEUE, "flaky", TaskLimit(breaker=breaker))
    first = [add(client, settings, "flaky") for _ in range(2)]
    assert read(client, streams, "c1")[0] == first  # closed: the first look samples
    outcomes(client, settings, "go", failed=2)
    outcomes(client, settings, "java", failed=1, succeeded=1)  # 3 of 4 failed, in any language
    time.sleep(1.05)  # samples are at least a second apart
    held = [add(client, settings, "flaky") for _ in range(3)]
    other = add(client, settings, "fast")
    taken, wait_ms, _ = read(client, streams, "c1")
    assert taken == [other] and limits.breaker_state(QUEUE, "flaky") == "open"
    assert 400 <= wait_ms <= 500  # the cool-down left
    time.sleep(0.55)
    assert read(client, streams, "c1")[0] == held[:1]  # half-open: one probe
    assert limits.breaker_state(QUEUE, "flaky") == "half_open"
    assert read(client, streams, "c1")[0] == []  # nothing more until the probe's outcome
    outcomes(client, settings, "node", succeeded=1)
    assert read(client, streams, "c1")[0] == held[1:]
    assert limits.breaker_state(QUEUE, "flaky") == "closed"


def test_a_failed_probe_opens_the_breaker_again(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "flaky", TaskLimit(breaker=Breaker(
        failure_ratio=1, min_attempts=1, window_s=10, cooldown_s=0.3)))
    read(client, streams, "c1")  # closed: the first sample
    outcomes(client, settings, "python", failed=1)
    time.sleep(1.05)
    ids = [add(client, settings, "flaky") for _ in range(2)]
    assert read(client, streams, "c1")[0] == []  # open
    time.sleep(0.35)
    assert read(client, streams, "c1")[0] == ids[:1]  # the probe
    outcomes(client, settings, "python", failed=1)
    assert read(client, streams, "c1")[0] == []
    assert TaskLimits(client, settings).breaker_state(QUEUE, "flaky") == "open"


def test_too_few_attempts_leave_the_breaker_closed(client, settings, streams) -> None:
    TaskLimits(client, settings).set(QUEUE, "flaky", TaskLimit(breaker=Breaker(
        failure_ratio=0.1, min_attempts=5)))
    read(client, streams, "c1")
    outcomes(client, settings, "go", failed=4)
    time.sleep(1.05)
    ids = [add(client, settings, "flaky") for _ in range(2)]
    assert read(client, streams, "c1")[0] == ids
    assert TaskLimits(client, settings).breaker_state(QUEUE, "flaky") == "closed"
