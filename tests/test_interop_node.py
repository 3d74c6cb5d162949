"""Cross-language scenarios with the Node.js SDK (``sdk/node``) through its peer CLI.

Real ``node`` subprocesses (``tests/interop/node/peer.js``, which uses the SDK as any
service would) share the session's private Redis with the Python implementation: the
Node producer and worker against Python's Publisher, Promoter, codec and dead-letter
tools. The module also runs the SDK's own suite (``node --test`` in ``sdk/node``:
conformance vectors, the README example, the worker on Redis), on the same Redis.

Skipped only when ``node`` is not on PATH, or when ``node_modules`` is missing and
``npm ci`` cannot install it (CI runs ``npm ci`` in both folders beforehand).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_for
from support.peers import NODE, NODE_SDK_DIR, NodePeer, node_unavailable

from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.codec import decode_body, decode_entry, encode_entry
from kombu_envelope.envelope import parse_rfc3339, utcnow
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket, KeySpace, bucket_for
from kombu_envelope.store.dead_letters import DeadLetters, dead_letter_envelope
from kombu_envelope.store.delayed import CancelOutcome, DelayedTasks
from kombu_envelope.store.promoter import Promoter

GROUP = "workers"

_UNAVAILABLE = node_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")


@pytest.fixture
def node(redis_url: str, key_prefix: str, tmp_path: Path) -> Iterator[NodePeer]:
    peer = NodePeer(redis_url, key_prefix, tmp_path)
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def queue() -> str:
    return f"q-{uuid.uuid4().hex[:8]}"


def fields_of(flat: dict[Any, Any]) -> dict[str, bytes]:
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in flat.items()}


def dead_entries(
    client: redis.Redis, prefix: str, queue: str
) -> list[tuple[str, dict[str, bytes]]]:
    return [(entry_id.decode(), fields_of(fields))
            for entry_id, fields in client.xrange(KeySpace(prefix).queue(queue).dead)]


def pending(client: redis.Redis, prefix: str, queue: str) -> int:
    total = 0
    for stream in KeySpace(prefix).queue(queue).task_streams:
        if client.exists(stream):
            total += int(client.xpending(stream, GROUP)["pending"])
    return total


def stream_lengths(client: redis.Redis, prefix: str, queue: str) -> int:
    return sum(client.xlen(stream) for stream in KeySpace(prefix).queue(queue).task_streams)


def redis_now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def text(value: bytes) -> str:
    return value.decode("utf-8")


# --------------------------------------------------------------------------- the peer's suite


#: The Node suite starts Sentinel groups and Clusters of its own: about a minute idle.
NODE_SUITE_TIMEOUT_S = 600
#: One test of the suite may take this long (ms): a test that hangs fails with its name
#: instead of holding up the whole suite.
NODE_TEST_TIMEOUT_MS = 120_000


def failed_tests(tap: str, lines_each: int = 40) -> str:
    """The ``not ok`` lines of a TAP report with what follows each (the failure), else its
    end: the suite prints hundreds of passing tests around a failing one."""
    lines = tap.splitlines()
    failing = [index for index, line in enumerate(lines) if line.lstrip().startswith("not ok")]
    if not failing:
        return tap[-6000:]
    return "\n".join("\n".join(lines[index:index + lines_each]) for index in failing)[-12000:]


@pytest.mark.timeout(NODE_SUITE_TIMEOUT_S + 30)
def test_node_suite_passes(redis_url: str) -> None:
    """``node --test`` in sdk/node: conformance vectors, time, codec, retries, the README
    example, the package's ESM, CommonJS and type entries, and the worker on Redis."""
    assert NODE is not None
    env = {**os.environ, "ENVELOPE_TEST_REDIS_URL": redis_url}
    done = subprocess.run([NODE, "--test", f"--test-timeout={NODE_TEST_TIMEOUT_MS}"],
                          cwd=NODE_SDK_DIR, env=env, capture_output=True, text=True,
                          timeout=NODE_SUITE_TIMEOUT_S, check=False)
    summary = [line for line in done.stdout.splitlines() if line.startswith("# ")]
    assert done.returncode == 0, failed_tests(done.stdout) + done.stderr[-2000:]
    assert "# fail 0" in summary, summary
    passed = [int(line.split()[2]) for line in summary if line.startswith("# pass ")]
    assert passed and passed[0] >= 250, summary


# --------------------------------------------------------------------------- scenarios


def test_node_delayed_task_promoted_by_python(
    node: NodePeer, client: redis.Redis, redis_url: str, key_prefix: str, queue: str
) -> None:
    """(a) Node writes schedule_time in +08:00; Python promotes it when due, not before."""
    trace_id = f"trace-{uuid.uuid4().hex}"
    task_id = node.run("produce", "--queue", queue, "--task-type", "order.close_timeout",
                       "--payload", '{"order_id": "202509110001"}', "--delay-ms", "2000",
                       "--tz-offset", "+08:00", "--trace-id", trace_id).strip()
    keys = KeySpace(key_prefix).queue(queue)
    assert client.sismember(KeySpace(key_prefix).queues, queue)
    due_ms = int(client.zscore(keys.delayed, task_id))
    stored = client.hget(keys.delayed_data, task_id)
    bucket, enc, body = stored.split(b"\n", 2)
    assert bucket == b"normal"
    written = json.loads(body)
    assert written["schedule_time"].endswith("+08:00")
    assert written["created_at"].endswith("+08:00")
    delayed = decode_body(enc, body)
    assert delayed.schedule_time is not None
    assert delayed.schedule_time.utcoffset() == timedelta(hours=8)
    assert delayed.due_ms() == due_ms  # Python reads the instant Node scored it with
    assert stream_lengths(client, key_prefix, queue) == 0

    promoter = Promoter(lambda: redis.Redis.from_url(redis_url), Settings(key_prefix=key_prefix),
                        max_idle_s=0.5)
    promoter.start()
    try:
        # Not in a stream before it is due (server clock, as promoters use).
        while redis_now_ms(client) < due_ms - 100:
            assert stream_lengths(client, key_prefix, queue) == 0
            time.sleep(0.05)
        entries = wait_for(lambda: client.xrange(keys.stream(Bucket.NORMAL)), timeout=5,
                           message="the promoter did not move the task")
        assert redis_now_ms(client) >= due_ms
    finally:
        promoter.stop()
    assert len(entries) == 1
    env = decode_entry(entries[0][1])
    assert env.task_id == task_id
    assert env.trace_id == trace_id
    assert env.schedule_time == parse_rfc3339(written["schedule_time"])
    assert env.schedule_time.utcoffset() == timedelta(hours=8)
    assert env.created_at == parse_rfc3339(written["created_at"])
    assert env.payload == {"order_id": "202509110001"}
    assert client.zcard(keys.delayed) == 0


def test_node_worker_dead_letters_exhausted_task(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """(b) test.fail with max_retries 2 and 200 ms backoff: three attempts, then the DLQ."""
    worker = node.worker(queue, "--backoff-ms", "200", "--max-backoff-ms", "1000",
                         "--lease-ms", "3000")
    started = time.monotonic()
    task_id = node.run("produce", "--queue", queue, "--task-type", "test.fail",
                       "--max-retries", "2", "--retry-policy", "tiered").strip()
    dead = wait_for(lambda: dead_entries(client, key_prefix, queue), timeout=15,
                    message=worker.log_tail)
    elapsed = time.monotonic() - started
    assert len(dead) == 1
    dead_id, fields = dead[0]
    assert text(fields["dlq"]) == "1"
    assert text(fields["failure_class"]) == "task_error"
    assert text(fields["attempts"]) == "3"
    assert text(fields["language"]) == "node"
    assert text(fields["queue"]) == queue
    assert text(fields["task_id"]) == task_id
    assert text(fields["task_type"]) == "test.fail"
    assert text(fields["exception_type"]) == "TestFailure"
    assert text(fields["reason"]) == "test.fail always fails"
    assert text(fields["pid"]) == str(worker.proc.pid)
    assert text(fields["consumer"]) == worker.consumer
    assert fields["host"]
    first, last = parse_rfc3339(text(fields["first_failure_at"])), parse_rfc3339(
        text(fields["last_failure_at"]))
    assert first <= last <= parse_rfc3339(text(fields["dead_at"]))
    assert last - first >= timedelta(milliseconds=400)  # two backoffs of ~200 and ~400 ms
    assert elapsed >= 0.45

    # The raw entry is the last attempt, byte for byte, and Python decodes it.
    raw = {name[4:]: value for name, value in fields.items() if name.startswith("raw.")}
    assert set(raw) == {"v", "enc", "body"}
    env = decode_entry(raw)
    assert env.task_id == task_id
    assert env.retry_count == 2
    assert env.max_retries == 2

    # The retries carried the first failure's time: it is the dead-letter's first_failure_at.
    assert env.headers["x-first-failure-at"] == text(fields["first_failure_at"])

    # Python's dead-letter tools see it.
    tools = DeadLetters(client, Settings(key_prefix=key_prefix))
    assert queue in tools.queues()
    entry = tools.get(queue, dead_id)
    assert entry is not None and entry.envelope is not None
    assert entry.envelope.task_id == task_id
    assert entry.failure_class == "task_error"

    assert pending(client, key_prefix, queue) == 0
    assert stream_lengths(client, key_prefix, queue) == 0
    assert client.zcard(KeySpace(key_prefix).queue(queue).delayed) == 0
    assert worker.stop() == 0


def test_python_dead_letter_replayed_with_an_edited_payload_by_node_runs_on_node(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """A dead letter Python wrote: listed and replayed (payload edited) with the Node SDK's
    DeadLetters, run by a Node worker; Python's tools see it replayed, a second replay is
    refused."""
    settings = Settings(key_prefix=key_prefix)
    envelope = Envelope.new(task_type="order.close_timeout", payload={"note": "no order id"},
                            max_retries=1, retry_count=1)
    dead_id = dead_letter_envelope(
        client, settings, queue=queue, envelope=envelope, consumer="py-consumer",
        failure=Failure(FailureClass.INVALID_PAYLOAD, "order_id is required",
                        exception_type="ValueError", task_id=envelope.task_id,
                        task_type=envelope.task_type))

    listed = [json.loads(line) for line in node.run("dead-list", "--queue", queue).splitlines()]
    assert [(e["id"], e["task_id"], e["failure_class"]) for e in listed] == [
        (dead_id, envelope.task_id, "invalid_payload")]
    assert listed[0]["fields"]["language"] == "python"
    assert listed[0]["envelope"]["trace_id"] == envelope.trace_id

    new_id = node.run("dead-replay", "--queue", queue, "--id", dead_id, "--operator", "ops@node",
                      "--merge-patch", json.dumps({"order_id": "DL-1", "note": None})).strip()
    stream = KeySpace(key_prefix).queue(queue).stream(bucket_for(envelope.priority))
    [(entry_id, fields)] = client.xrange(stream)
    assert entry_id.decode() == new_id
    replayed = decode_entry(fields_of(fields))
    assert replayed.task_id == envelope.task_id and replayed.trace_id == envelope.trace_id
    assert replayed.payload == {"order_id": "DL-1"}
    assert replayed.retry_count == 0

    done = subprocess.run(node.command("dead-replay", "--queue", queue, "--id", dead_id),
                          capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 3, done.stderr
    assert DeadLetters(client, settings).list([queue]) == []
    [(_, record)] = client.xrange(KeySpace(key_prefix).queue(queue).replayed)
    assert record[b"dead_id"].decode() == dead_id and record[b"operator"] == b"ops@node"

    worker = node.worker(queue)
    wait_for(lambda: client.get(f"{key_prefix}:effects:order.close_timeout:DL-1") == b"1",
             timeout=10, message=worker.log_tail)
    assert worker.stop() == 0


def test_python_task_runs_once_on_node_worker(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """(c) Python publishes order.close_timeout (plain and gzip); the Node worker runs each once."""
    worker = node.worker(queue)
    publisher = Publisher(client, Settings(key_prefix=key_prefix))
    plain = Envelope.new(task_type="order.close_timeout", payload={"order_id": "202509110001"})
    large = Envelope.new(task_type="order.close_timeout",
                         payload={"order_id": "202509110002", "notes": "x" * 20_000})
    publisher.publish(queue, plain)
    publisher.publish(queue, large)

    effects = f"{key_prefix}:effects:order.close_timeout"
    wait_for(lambda: client.llen(f"{key_prefix}:effects:log") == 2, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: pending(client, key_prefix, queue) == 0
             and stream_lengths(client, key_prefix, queue) == 0, timeout=5)
    time.sleep(0.3)  # nothing runs a second time
    assert client.get(f"{effects}:202509110001") == b"1"
    assert client.get(f"{effects}:202509110002") == b"1"
    assert client.lrange(f"{key_prefix}:effects:log", 0, -1) == [
        f"node:{plain.task_id}".encode(), f"node:{large.task_id}".encode()]

    succeeded = [line for line in worker.lines() if line["msg"] == "task succeeded"]
    assert {(line["task_id"], line["trace_id"]) for line in succeeded} == {
        (plain.task_id, plain.trace_id), (large.task_id, large.trace_id)}

    consumer_key = KeySpace(key_prefix).consumer(worker.consumer)
    assert client.get(consumer_key).endswith(b" node")
    assert worker.stop() == 0
    assert client.exists(consumer_key) == 0


MALFORMED_KINDS = ("badjson", "missingbody", "badversion", "badgzip", "invalid")


def test_malformed_entries_dead_lettered_and_worker_goes_on(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """(d) Malformed entries land in the DLQ with their raw bytes; the next task still runs."""
    worker = node.worker(queue)
    written = {}
    for kind in MALFORMED_KINDS:
        out = json.loads(node.run("produce-malformed", "--queue", queue, "--kind", kind))
        written[out["entry_id"]] = (kind, {name: base64.b64decode(value)
                                           for name, value in out["fields_base64"].items()})
    task_id = node.run("produce", "--queue", queue, "--task-type", "order.close_timeout",
                       "--payload", '{"order_id": "after-malformed"}').strip()

    wait_for(lambda: client.get(f"{key_prefix}:effects:order.close_timeout:after-malformed"),
             timeout=10, message=worker.log_tail)
    dead = dead_entries(client, key_prefix, queue)
    assert len(dead) == len(MALFORMED_KINDS)
    seen = set()
    for _dead_id, fields in dead:
        raw = {name[4:]: value for name, value in fields.items() if name.startswith("raw.")}
        matches = [kind for kind, original in written.values() if original == raw]
        assert len(matches) == 1, f"raw fields not kept byte for byte: {raw!r}"
        seen.add(matches[0])
        assert text(fields["failure_class"]) == "malformed_entry"
        assert text(fields["language"]) == "node"
        assert fields["reason"]
    assert seen == set(MALFORMED_KINDS)
    assert worker.proc.poll() is None, "the worker must survive malformed input"
    assert pending(client, key_prefix, queue) == 0
    assert stream_lengths(client, key_prefix, queue) == 0
    assert client.lrange(f"{key_prefix}:effects:log", 0, -1) == [f"node:{task_id}".encode()]
    assert worker.stop() == 0
    # Every log line was JSON (lines() parses them all) with trace_id and task_id.
    assert all("trace_id" in line and "task_id" in line for line in worker.lines())


def test_same_idempotency_key_from_node_and_python_runs_once(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """(e) One business action, published by Node and by Python with the same key: one effect."""
    worker = node.worker(queue)
    key = "202509110001"
    node_task = node.run("produce", "--queue", queue, "--task-type", "order.close_timeout",
                         "--payload", '{"order_id": "202509110001"}',
                         "--idempotency-key", key).strip()
    python_task = Envelope.new(task_type="order.close_timeout", payload={"order_id": key},
                               idempotency_key=key)
    Publisher(client, Settings(key_prefix=key_prefix)).publish(queue, python_task)

    def settled() -> bool:
        return (pending(client, key_prefix, queue) == 0
                and stream_lengths(client, key_prefix, queue) == 0
                and client.zcard(KeySpace(key_prefix).queue(queue).delayed) == 0
                and any(line["msg"].startswith("duplicate") for line in worker.lines()))

    wait_for(settled, timeout=15, message=worker.log_tail)
    assert client.get(f"{key_prefix}:effects:order.close_timeout:{key}") == b"1"
    assert client.lrange(f"{key_prefix}:effects:log", 0, -1) == [f"node:{node_task}".encode()]
    marker = client.get(f"{key_prefix}:idem:order.close_timeout:{key}")
    assert marker is not None and marker.startswith(f"done {node_task} ".encode())
    duplicates = [line for line in worker.lines() if line["msg"].startswith("duplicate")]
    assert [line["task_id"] for line in duplicates] == [python_task.task_id]
    assert duplicates[0]["trace_id"] == python_task.trace_id
    assert dead_entries(client, key_prefix, queue) == []
    assert worker.stop() == 0


def test_sigterm_returns_prefetched_entries(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """SIGTERM: the running task finishes, prefetched ones go back, the liveness key goes."""
    keys = KeySpace(key_prefix).queue(queue)
    worker = node.worker(queue, "--prefetch", "3", "--block-ms", "3000",
                         "--shutdown-grace-ms", "5000")
    time.sleep(0.3)  # the worker is now parked in its blocking read
    # One entry per bucket in one transaction: the most urgent one runs, the two others
    # are read ahead (--prefetch 3) and wait.
    sleeper = Envelope.new(task_type="test.sleep", payload={"ms": 1500}, priority=200)
    waiting = [Envelope.new(task_type="order.close_timeout", payload={"order_id": f"w{i}"},
                            priority=priority) for i, priority in enumerate((100, 10))]
    pipe = client.pipeline(transaction=True)
    for env in (sleeper, *waiting):
        pipe.xadd(keys.stream(bucket_for(env.priority)), encode_entry(env))
    pipe.execute()
    wait_for(lambda: pending(client, key_prefix, queue) == 3, timeout=3, message=worker.log_tail)
    # Read is not yet started: the sleeper runs once its record says "running".
    wait_for(lambda: client.hget(keys.task_record(sleeper.task_id), "state") == b"running",
             timeout=5, message=worker.log_tail)
    assert worker.stop() == 0
    lines = worker.lines()
    assert any(line["msg"] == "task succeeded" and line["task_id"] == sleeper.task_id
               for line in lines)
    requeued = {line["task_id"] for line in lines if line["msg"] == "entry put back in its stream"}
    assert requeued == {env.task_id for env in waiting}
    assert client.get(f"{key_prefix}:effects:order.close_timeout:w0") is None
    assert pending(client, key_prefix, queue) == 0
    assert client.xlen(keys.stream(Bucket.NORMAL)) == 1
    assert client.xlen(keys.stream(Bucket.LOW)) == 1
    assert client.exists(KeySpace(key_prefix).consumer(worker.consumer)) == 0


def test_task_cancelled_by_python_after_promotion_is_skipped_by_node(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """Python marks a task already in its stream cancelled (ZSET); the Node worker skips it."""
    publisher = Publisher(client, Settings(key_prefix=key_prefix))
    cancelled = Envelope.new(task_type="order.close_timeout", payload={"order_id": "x-cancelled"})
    kept = Envelope.new(task_type="order.close_timeout", payload={"order_id": "x-kept"})
    publisher.publish(queue, cancelled)
    publisher.publish(queue, kept)
    outcome = DelayedTasks(client, Settings(key_prefix=key_prefix)).cancel(cancelled.task_id, queue)
    assert outcome == CancelOutcome.MARKED
    marks = KeySpace(key_prefix).cancelled
    assert client.zscore(marks, cancelled.task_id) is not None

    worker = node.worker(queue)
    wait_for(lambda: client.get(f"{key_prefix}:effects:order.close_timeout:x-kept"), timeout=10,
             message=worker.log_tail)
    wait_for(lambda: pending(client, key_prefix, queue) == 0
             and stream_lengths(client, key_prefix, queue) == 0, timeout=5)
    assert client.get(f"{key_prefix}:effects:order.close_timeout:x-cancelled") is None
    # The mark stays (section 10), so the id published again within 7 days is skipped too.
    assert client.zscore(marks, cancelled.task_id) is not None
    skipped = [line["task_id"] for line in worker.lines()
               if line["msg"].startswith("task was cancelled")]
    assert skipped == [cancelled.task_id]
    assert worker.stop() == 0


def test_node_publishing_now_replaces_a_task_python_scheduled(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """enqueue.lua: a task Python scheduled and Node then publishes to run now is delivered once."""
    keys = KeySpace(key_prefix).queue(queue)
    later = Envelope.new(task_type="order.close_timeout", payload={"order_id": "y-1"},
                         schedule_time=utcnow() + timedelta(hours=1))
    assert Publisher(client, Settings(key_prefix=key_prefix)).publish(queue, later) is None
    assert client.zscore(keys.delayed, later.task_id) is not None
    task_id = node.run("produce", "--queue", queue, "--task-type", "order.close_timeout",
                       "--payload", '{"order_id": "y-1"}', "--task-id", later.task_id).strip()
    assert task_id == later.task_id
    assert client.zcard(keys.delayed) == 0 and client.hlen(keys.delayed_data) == 0
    assert stream_lengths(client, key_prefix, queue) == 1


def test_node_dead_letters_an_entry_whose_consumers_keep_dying(
    node: NodePeer, client: redis.Redis, key_prefix: str, queue: str
) -> None:
    """requeue.lua past max_redeliveries: a redelivery_limit entry that says who, seen by Python."""
    keys = KeySpace(key_prefix).queue(queue)
    env = Envelope.new(task_type="order.close_timeout", payload={"order_id": "z-1"})
    stream = keys.stream(Bucket.NORMAL)
    for name in keys.task_streams:
        client.xgroup_create(name, GROUP, id="0", mkstream=True)
    written: dict[Any, Any] = {**encode_entry(env), "n": b"2"}  # its consumer died twice already
    client.xadd(stream, written)
    client.xreadgroup(GROUP, "ghost-z", {stream: ">"}, count=1)  # and dies again

    worker = node.worker(queue, "--lease-ms", "600", "--max-redeliveries", "3")
    dead = wait_for(lambda: dead_entries(client, key_prefix, queue), timeout=10,
                    message=worker.log_tail)
    [(dead_id, fields)] = dead
    assert text(fields["failure_class"]) == "redelivery_limit"
    assert text(fields["redeliveries"]) == "3" and "attempts" not in fields
    assert text(fields["queue"]) == queue
    assert text(fields["language"]) == "node"
    assert text(fields["consumer"]) == "ghost-z"  # who died holding it
    assert text(fields["pid"]) == str(worker.proc.pid)
    assert text(fields["source_stream"]) == stream
    tools = DeadLetters(client, Settings(key_prefix=key_prefix))
    assert queue in tools.queues()
    entry = tools.get(queue, dead_id)
    assert entry is not None and entry.envelope is not None
    assert entry.envelope.task_id == env.task_id
    assert client.get(f"{key_prefix}:effects:order.close_timeout:z-1") is None
    assert worker.stop() == 0
