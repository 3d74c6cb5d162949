"""Go and Python on the same queues: the Go reference peer in ``tests/interop/go``.

The peer is built once per session (``go build``) and run as real subprocesses
(``produce``, ``produce-malformed``, ``worker``) against the session's private
Redis; Python publishes, promotes and decodes with the library itself.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_for
from support.peers import (
    FIRST_BUILD_TIMEOUT_S,
    GO,
    GO_DIR,
    GO_SDK_DIR,
    GoPeer,
    build_go_peer,
    go_env,
)

from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.codec import decode_entry, encode_entry
from kombu_envelope.envelope import format_rfc3339, parse_rfc3339
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.keys import KeySpace
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.delayed import CancelOutcome, DelayedTasks
from kombu_envelope.store.promoter import Promoter

pytestmark = [
    pytest.mark.skipif(GO is None, reason="the Go toolchain (`go`) is not on PATH"),
    # Whichever test comes first also waits for the session's `go build`.
    pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S + 120),
]

GROUP = "workers"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@pytest.fixture(scope="session")
def go_peer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The peer binary, built once per session."""
    return build_go_peer(tmp_path_factory)


@pytest.fixture
def peer(go_peer: Path, redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[GoPeer]:
    p = GoPeer(go_peer, redis_url, key_prefix, f"orders-{uuid.uuid4().hex[:6]}", tmp_path)
    try:
        yield p
    finally:
        p.close()


def publisher(client: redis.Redis, prefix: str) -> Publisher:
    return Publisher(client, Settings(key_prefix=prefix))


def queue_is_drained(client: redis.Redis, prefix: str, queue: str) -> bool:
    """Every task stream empty with nothing pending, and nothing delayed."""
    keys = KeySpace(prefix).queue(queue)
    for stream in keys.task_streams:
        if client.xlen(stream):
            return False
        if client.exists(stream) and client.xpending(stream, GROUP)["pending"]:
            return False
    return not client.zcard(keys.delayed) and not client.hlen(keys.delayed_data)


def dead_entries(client: redis.Redis, prefix: str, queue: str) -> list[dict[str, bytes]]:
    return [{k.decode(): v for k, v in fields.items()}
            for _, fields in client.xrange(KeySpace(prefix).queue(queue).dead)]


def raw_fields(dead: dict[str, bytes]) -> dict[bytes, bytes]:
    return {k[len("raw."):].encode(): v for k, v in dead.items() if k.startswith("raw.")}


def effect(client: redis.Redis, prefix: str, order_id: str) -> int:
    return int(client.get(f"{prefix}:effects:order.close_timeout:{order_id}") or 0)


# --- the Go SDK's own test-suite: conformance vectors, unit and Redis tests, README example --


#: The Go suite starts Sentinel groups and Clusters of its own: about a minute idle.
GO_SUITE_TIMEOUT_S = 400


@pytest.mark.timeout(GO_SUITE_TIMEOUT_S + 30)
def test_go_sdk_suite(go_peer: Path, redis_url: str) -> None:
    done = subprocess.run(
        [GO, "test", "-count=1", "./..."], cwd=GO_SDK_DIR, capture_output=True, text=True,
        timeout=GO_SUITE_TIMEOUT_S, env=go_env(ENVELOPE_TEST_REDIS_URL=redis_url),
    )
    assert done.returncode == 0, f"go test failed in sdk/go:\n{done.stdout}\n{done.stderr}"


def test_go_peer_vets(go_peer: Path) -> None:
    """The interop command builds against the SDK as a user's module would, and vets clean."""
    done = subprocess.run([GO, "vet", "./..."], cwd=GO_DIR, capture_output=True, text=True,
                          timeout=FIRST_BUILD_TIMEOUT_S, env=go_env())
    assert done.returncode == 0, f"go vet failed in tests/interop/go:\n{done.stdout}\n{done.stderr}"


# --- cross-language scenarios --------------------------------------------------------------


def test_python_publishes_go_worker_runs_and_acks(peer: GoPeer, client: redis.Redis) -> None:
    order_id = "202509110001"
    env = Envelope.new(task_type="order.close_timeout",
                       payload={"order_id": order_id, "store_id": 7})
    publisher(client, peer.prefix).publish(peer.queue, env)

    worker = peer.worker()
    wait_for(lambda: effect(client, peer.prefix, order_id) == 1, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    assert client.lrange(f"{peer.prefix}:effects:log", 0, -1) == [f"go:{env.task_id}".encode()]
    done = [line for line in worker.log_lines() if line.get("outcome") == "success"]
    assert [(line["task_id"], line["trace_id"]) for line in done] == [(env.task_id, env.trace_id)]

    assert worker.stop() == 0, worker.log_tail()
    assert effect(client, peer.prefix, order_id) == 1
    assert not client.keys(f"{peer.prefix}:consumer:*")  # liveness key deleted on SIGTERM
    assert dead_entries(client, peer.prefix, peer.queue) == []


def test_go_delayed_task_in_plus_0800_is_promoted_by_python(
    peer: GoPeer, client: redis.Redis, redis_url: str
) -> None:
    due = (datetime.now(timezone(timedelta(hours=8))) + timedelta(seconds=1.5))
    due_text = format_rfc3339(due)
    assert due_text.endswith("+08:00")
    trace_id = uuid.uuid4().hex
    [task_id] = peer.produce("--task-type", "order.close_timeout",
                             "--payload", '{"order_id": "b-1", "store_id": 3}',
                             "--schedule-time", due_text, "--trace-id", trace_id)
    keys = KeySpace(peer.prefix).queue(peer.queue)
    due_ms = (parse_rfc3339(due_text) - EPOCH) // timedelta(milliseconds=1)
    assert client.zscore(keys.delayed, task_id) == due_ms
    assert client.sismember(f"{peer.prefix}:queues", peer.queue)
    assert b'"schedule_time":"' + due_text.encode() + b'"' in client.hget(keys.delayed_data,
                                                                           task_id)

    promoter = Promoter(lambda: redis.Redis.from_url(redis_url), Settings(key_prefix=peer.prefix))
    try:
        moved, next_due = promoter.run_once()
        assert (moved, next_due) == (0, due_ms)  # not due yet
        wait_for(lambda: promoter.run_once()[0] == 1, timeout=10, interval=0.05)
    finally:
        promoter.client.close()
    seconds, micros = client.time()
    assert seconds * 1000 + micros // 1000 >= due_ms

    entries = client.xrange(keys.task_streams[1])
    assert len(entries) == 1
    env = decode_entry(entries[0][1])
    assert (env.task_id, env.trace_id, env.task_type) == (task_id, trace_id, "order.close_timeout")
    assert env.payload == {"order_id": "b-1", "store_id": 3}
    assert env.schedule_time == due  # the same instant...
    assert env.schedule_time.utcoffset() == timedelta(hours=8)  # ...in the offset it was given
    assert not client.zcard(keys.delayed)


def test_same_idempotency_key_from_go_and_python_runs_once(
    peer: GoPeer, client: redis.Redis
) -> None:
    order_id = f"c-{uuid.uuid4().hex[:8]}"
    [go_task] = peer.produce("--task-type", "order.close_timeout",
                             "--payload", json.dumps({"order_id": order_id, "store_id": 1}),
                             "--idempotency-key", order_id)
    py_env = Envelope.new(task_type="order.close_timeout",
                          payload={"order_id": order_id, "store_id": 1},
                          idempotency_key=order_id)
    publisher(client, peer.prefix).publish(peer.queue, py_env)
    assert py_env.task_id != go_task

    worker = peer.worker("--concurrency", "2", "--defer-ms", "300")
    duplicates = f"{peer.prefix}:effects:duplicates"
    wait_for(lambda: client.llen(duplicates) == 1, timeout=15, message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    assert effect(client, peer.prefix, order_id) == 1
    [ran] = client.lrange(f"{peer.prefix}:effects:log", 0, -1)
    [dup] = client.lrange(duplicates, 0, -1)
    assert {ran, dup} == {f"go:{go_task}".encode(), f"go:{py_env.task_id}".encode()}
    marker = client.get(f"{peer.prefix}:idem:order.close_timeout:{order_id}")
    assert marker.startswith(b"done " + ran.split(b":", 1)[1] + b" ")
    assert [line["task_id"] for line in worker.log_lines()
            if line.get("outcome") == "duplicate"] == [dup.decode().split(":", 1)[1]]
    assert worker.stop() == 0, worker.log_tail()


MALFORMED = {
    "badjson": {"v": b"1", "enc": b"json", "body": b'{"task_type": "order.close_timeout",'},
    "missingbody": {"v": b"1", "enc": b"json"},
    "badversion": {"v": b"99", "enc": b"json"},
    "badgzip": {"v": b"1", "enc": b"json+gzip"},
    "invalid": {"v": b"1", "enc": b"json"},
}


def test_malformed_entries_are_dead_lettered_and_the_go_worker_goes_on(
    peer: GoPeer, client: redis.Redis
) -> None:
    worker = peer.worker()
    for kind in MALFORMED:
        peer.run("produce-malformed", "--kind", kind)
    wait_for(lambda: len(dead_entries(client, peer.prefix, peer.queue)) == len(MALFORMED),
             timeout=10, message=worker.log_tail)
    assert worker.alive()

    for dead, (kind, expected) in zip(dead_entries(client, peer.prefix, peer.queue),
                                      MALFORMED.items()):
        assert dead["failure_class"] == b"malformed_entry", kind
        assert dead["dlq"] == b"1" and dead["language"] == b"go" and dead["reason"], kind
        assert dead["queue"] == peer.queue.encode()
        raw = raw_fields(dead)
        for name, value in expected.items():
            assert raw[name.encode()] == value, (kind, name)
        assert (b"body" in raw) == (kind != "missingbody")
        with pytest.raises(MalformedEntry):  # Python agrees that it is malformed
            decode_entry(raw)

    order_id = f"d-{uuid.uuid4().hex[:8]}"
    publisher(client, peer.prefix).publish(
        peer.queue, Envelope.new(task_type="order.close_timeout",
                                 payload={"order_id": order_id, "store_id": 2}))
    wait_for(lambda: effect(client, peer.prefix, order_id) == 1, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    assert worker.stop() == 0, worker.log_tail()


def test_failing_task_exhausts_its_retries_into_the_dead_letter_stream(
    peer: GoPeer, client: redis.Redis
) -> None:
    env = Envelope.new(task_type="test.fail", payload={"n": 1}, max_retries=2,
                       headers={"x-retry-policy": "tiered"})
    publisher(client, peer.prefix).publish(peer.queue, env)
    worker = peer.worker("--backoff-ms", "200", "--fast-retries", "2")
    wait_for(lambda: dead_entries(client, peer.prefix, peer.queue), timeout=15,
             message=worker.log_tail)
    [dead] = dead_entries(client, peer.prefix, peer.queue)
    assert dead["failure_class"] == b"task_error"
    assert dead["attempts"] == b"3"
    assert dead["language"] == b"go"
    assert dead["task_id"] == env.task_id.encode()
    assert dead["task_type"] == b"test.fail"
    assert dead["exception_type"] == b"TestFailure"
    assert dead["queue"] == peer.queue.encode()
    assert dead["pid"] == str(worker.proc.pid).encode()
    first = parse_rfc3339(dead["first_failure_at"].decode())
    last = parse_rfc3339(dead["last_failure_at"].decode())
    dead_at = parse_rfc3339(dead["dead_at"].decode())
    assert first <= last <= dead_at
    assert last - first >= timedelta(milliseconds=400)  # two backoff delays: ~200 ms + ~400 ms

    last_attempt = decode_entry(raw_fields(dead))
    assert last_attempt.task_id == env.task_id and last_attempt.trace_id == env.trace_id
    assert (last_attempt.retry_count, last_attempt.max_retries) == (2, 2)
    assert last_attempt.payload == {"n": 1}
    assert last_attempt.created_at == env.created_at
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=5)
    assert not client.zcard(f"{peer.prefix}:retrying:test.fail")  # retry slots released
    attempts = [line for line in worker.log_lines() if line.get("task_id") == env.task_id
                and line.get("outcome") in ("retry", "dead")]
    assert [line["outcome"] for line in attempts] == ["retry", "retry", "dead", "dead"]
    # The retries carried the first failure's time: it is the dead-letter's first_failure_at.
    assert last_attempt.headers["x-first-failure-at"] == dead["first_failure_at"].decode()
    # Python's dead-letter tools list the queue (SADD <prefix>:dead-queues).
    assert peer.queue in DeadLetters(client, Settings(key_prefix=peer.prefix)).queues()
    assert worker.stop() == 0, worker.log_tail()


def test_task_cancelled_by_python_after_promotion_is_skipped_by_go(
    peer: GoPeer, client: redis.Redis
) -> None:
    pub = publisher(client, peer.prefix)
    cancelled = Envelope.new(task_type="order.close_timeout",
                             payload={"order_id": "x-cancelled", "store_id": 1})
    kept = Envelope.new(task_type="order.close_timeout",
                        payload={"order_id": "x-kept", "store_id": 1})
    pub.publish(peer.queue, cancelled)
    pub.publish(peer.queue, kept)
    outcome = DelayedTasks(client, Settings(key_prefix=peer.prefix)).cancel(cancelled.task_id,
                                                                            peer.queue)
    assert outcome == CancelOutcome.MARKED  # already in its stream: a mark in the ZSET
    marks = KeySpace(peer.prefix).cancelled
    assert client.zscore(marks, cancelled.task_id) is not None

    worker = peer.worker()
    wait_for(lambda: effect(client, peer.prefix, "x-kept") == 1, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    assert effect(client, peer.prefix, "x-cancelled") == 0
    # The mark stays (section 10), so the id published again within 7 days is skipped too.
    assert client.zscore(marks, cancelled.task_id) is not None
    assert [line["task_id"] for line in worker.log_lines()
            if line.get("outcome") == "cancelled"] == [cancelled.task_id]
    assert worker.stop() == 0, worker.log_tail()


def test_go_publishing_now_replaces_a_task_python_scheduled(
    peer: GoPeer, client: redis.Redis
) -> None:
    keys = KeySpace(peer.prefix).queue(peer.queue)
    later = Envelope.new(task_type="order.close_timeout",
                         payload={"order_id": "y-1", "store_id": 1},
                         schedule_time=datetime.now(timezone.utc) + timedelta(hours=1))
    assert publisher(client, peer.prefix).publish(peer.queue, later) is None
    assert client.zscore(keys.delayed, later.task_id) is not None

    [task_id] = peer.produce("--task-type", "order.close_timeout",
                             "--payload", '{"order_id": "y-1", "store_id": 1}',
                             "--task-id", later.task_id)
    assert task_id == later.task_id
    assert client.zcard(keys.delayed) == 0 and client.hlen(keys.delayed_data) == 0
    worker = peer.worker()
    wait_for(lambda: effect(client, peer.prefix, "y-1") == 1, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    assert effect(client, peer.prefix, "y-1") == 1
    assert worker.stop() == 0, worker.log_tail()


def test_go_dead_letters_an_entry_whose_consumers_keep_dying(
    peer: GoPeer, client: redis.Redis
) -> None:
    keys = KeySpace(peer.prefix).queue(peer.queue)
    env = Envelope.new(task_type="order.close_timeout",
                       payload={"order_id": "z-1", "store_id": 1})
    stream = keys.task_streams[1]
    for name in keys.task_streams:
        client.xgroup_create(name, GROUP, id="0", mkstream=True)
    written: dict[Any, Any] = {**encode_entry(env), "n": b"2"}  # its consumer died twice already
    client.xadd(stream, written)
    client.xreadgroup(GROUP, "ghost-z", {stream: ">"}, count=1)  # and dies again

    worker = peer.worker("--lease-ms", "600", "--max-redeliveries", "3")
    wait_for(lambda: dead_entries(client, peer.prefix, peer.queue), timeout=10,
             message=worker.log_tail)
    [dead] = dead_entries(client, peer.prefix, peer.queue)
    assert dead["failure_class"] == b"redelivery_limit"
    assert dead["redeliveries"] == b"3" and "attempts" not in dead
    assert dead["queue"] == peer.queue.encode()
    assert dead["language"] == b"go"
    assert dead["consumer"] == b"ghost-z"  # who died holding it
    assert dead["pid"] == str(worker.proc.pid).encode()
    assert dead["source_stream"] == stream.encode()
    assert decode_entry(raw_fields(dead)).task_id == env.task_id
    tools = DeadLetters(client, Settings(key_prefix=peer.prefix))
    assert peer.queue in tools.queues()
    assert effect(client, peer.prefix, "z-1") == 0
    assert worker.stop() == 0, worker.log_tail()


def test_sigterm_puts_prefetched_entries_back(peer: GoPeer, client: redis.Redis) -> None:
    tasks = peer.produce("--task-type", "test.sleep", "--payload", '{"ms": 1500}',
                         "--count", "3")
    worker = peer.worker("--prefetch", "3")
    stream = KeySpace(peer.prefix).queue(peer.queue).task_streams[1]
    wait_for(lambda: client.xpending(stream, GROUP)["pending"] == 3, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: any(line.get("msg") == "task started" for line in worker.log_lines()),
             timeout=10, message=worker.log_tail)
    assert worker.stop() == 0, worker.log_tail()

    remaining = [decode_entry(fields).task_id for _, fields in client.xrange(stream)]
    assert remaining == tasks[1:]  # the first one ran to completion, the others went back
    assert client.xpending(stream, GROUP)["pending"] == 0
    assert not client.keys(f"{peer.prefix}:consumer:*")
    succeeded = [line["task_id"] for line in worker.log_lines()
                 if line.get("outcome") == "success"]
    assert succeeded == tasks[:1]

