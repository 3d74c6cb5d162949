"""Celery, Go and Node.js on the same queues: real ``celery worker`` processes with the peers.

Each scenario runs a real Celery app (``tests/apps/interop_app.py``) on ``envelope://``
with a key prefix of its own and late acknowledgement, real ``celery worker``
subprocesses, and the reference peers of ``tests/interop`` as subprocesses (the Go
binary is built once per session). Every process is killed at teardown.

What differs between languages on purpose:

* a Go or Node worker does not write Celery's result backend: a task a Celery app sent
  to a queue only they consume stays ``PENDING`` there;
* ``exception_type`` in a dead-letter entry names the error the way its language does
  (``apps.interop_app.TestFailure`` for Python, ``TestFailure`` for the peers);
* the failure fields of a dead-letter entry are the same in Python and Node; the Go
  peer writes ``traceback`` only for a panic (the field is optional, "when known").
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from apps.interop_app import create_app
from celery import Celery
from support import wait_for
from support.envelope_streams import envelope_url, pending_count
from support.peers import (
    FIRST_BUILD_TIMEOUT_S,
    GO,
    GoPeer,
    GoWorker,
    NodePeer,
    NodeWorker,
    build_go_peer,
    node_unavailable,
)
from support.workers import CeleryWorker

from celery_ext import trace
from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope, parse_rfc3339
from kombu_envelope.errors import MalformedEntry
from kombu_envelope.keys import KeySpace
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters, ReplayEdit

APP = "apps.interop_app"
GROUP = "workers"
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

needs_go = pytest.mark.skipif(GO is None, reason="the Go toolchain (`go`) is not on PATH")
needs_node = pytest.mark.skipif(node_unavailable() is not None,
                                reason=node_unavailable() or "")
pytestmark = pytest.mark.timeout(FIRST_BUILD_TIMEOUT_S + 120)  # the first test builds Go


# --------------------------------------------------------------------------- fixtures


class Interop:
    """Starts the Celery workers and peers of one test on one key prefix; stops them all."""

    def __init__(self, request: pytest.FixtureRequest, redis_url: str, prefix: str,
                 tmp: Path) -> None:
        self.request = request
        self.redis_url = redis_url
        self.prefix = prefix
        self.tmp = tmp
        self.node = NodePeer(redis_url, prefix, tmp)
        self.go_peers: list[GoPeer] = []
        self.celery_workers: list[CeleryWorker] = []

    def go(self, queue: str) -> GoPeer:
        """The Go peer on ``queue`` (the binary is built on first use)."""
        binary = self.request.getfixturevalue("go_binary")
        peer = GoPeer(binary, self.redis_url, self.prefix, queue, self.tmp)
        self.go_peers.append(peer)
        return peer

    def celery_worker(self, *queues: str, lease_ms: int = 3000) -> CeleryWorker:
        """A started ``celery worker`` (solo pool) consuming ``queues`` only."""
        worker = CeleryWorker(
            APP, queues=queues, log_path=self.tmp / f"celery-{queues[0]}.log",
            env={"TEST_BROKER_URL": envelope_url(self.redis_url),
                 "TEST_RESULT_BACKEND": self.redis_url, "TEST_KEY_PREFIX": self.prefix,
                 "TEST_LEASE_MS": str(lease_ms)},
        )
        self.celery_workers.append(worker)
        return worker.start()

    def close(self) -> None:
        for worker in self.celery_workers:
            worker.close()
        for peer in self.go_peers:
            peer.close()
        self.node.close()


@pytest.fixture(scope="session")
def go_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_go_peer(tmp_path_factory)


@pytest.fixture
def interop(request: pytest.FixtureRequest, redis_url: str, key_prefix: str,
            tmp_path: Path) -> Iterator[Interop]:
    started = Interop(request, redis_url, key_prefix, tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def celery_app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    """The publishing side: the same app the workers run, in this process."""
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, 3000)
    try:
        yield app
    finally:
        # An AsyncResult unsubscribes from the result backend when collected: collect
        # those left in reference cycles while Redis still runs.
        gc.collect()
        app.close()


def new_queue(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


# --------------------------------------------------------------------------- helpers


def effect(client: redis.Redis, prefix: str, order_id: str) -> int:
    return int(client.get(f"{prefix}:effects:order.close_timeout:{order_id}") or 0)


def effects_log(client: redis.Redis, prefix: str) -> list[str]:
    """``<language>:<task_id>`` of every order.close_timeout run, in order."""
    return [item.decode() for item in client.lrange(f"{prefix}:effects:log", 0, -1)]


def queue_is_drained(client: redis.Redis, prefix: str, queue: str) -> bool:
    """Every task stream empty with nothing pending, and nothing delayed."""
    keys = KeySpace(prefix).queue(queue)
    return (not any(client.xlen(stream) or pending_count(client, stream, GROUP)
                    for stream in keys.task_streams)
            and not client.zcard(keys.delayed) and not client.hlen(keys.delayed_data))


def stream_envelopes(client: redis.Redis, prefix: str, queue: str) -> list[Envelope]:
    keys = KeySpace(prefix).queue(queue)
    return [decode_entry(fields) for stream in keys.task_streams
            for _, fields in client.xrange(stream)]


def epoch_ms(when: datetime) -> int:
    return (when - EPOCH) // timedelta(milliseconds=1)


def python_duplicates(worker: CeleryWorker) -> list[str]:
    """Task ids the Celery worker skipped because their idempotency key was done."""
    return re.findall(r"order\.close_timeout\[([^\]]+)\] is a duplicate", worker.log_text())


def tails(*workers: CeleryWorker | GoWorker | NodeWorker) -> str:
    return "\n".join(f"--- {worker!r}\n{worker.log_tail()}" for worker in workers)


# --------------------------------------------------------------------------- scenarios


@needs_go
def test_celery_app_publishes_go_worker_runs_and_acks(
    interop: Interop, celery_app: Celery, client: redis.Redis
) -> None:
    """1. ``send_task`` from a Celery app to a queue only a Go worker consumes."""
    prefix, queue = interop.prefix, new_queue("go-only")
    trace_id = uuid.uuid4().hex
    with trace(trace_id):
        sent = celery_app.send_task("order.close_timeout",
                                    kwargs={"order_id": "c1-202509110001", "store_id": 7},
                                    queue=queue)
    # On the wire: a plain Envelope whose payload is the kwargs.
    [env] = stream_envelopes(client, prefix, queue)
    assert (env.task_id, env.task_type, env.trace_id) == (sent.id, "order.close_timeout",
                                                          trace_id)
    assert env.payload == {"order_id": "c1-202509110001", "store_id": 7}

    worker = interop.go(queue).worker()
    wait_for(lambda: effect(client, prefix, "c1-202509110001") == 1, timeout=10,
             message=worker.log_tail)
    wait_for(lambda: queue_is_drained(client, prefix, queue), timeout=10,
             message=worker.log_tail)
    assert effects_log(client, prefix) == [f"go:{sent.id}"]
    done = [line for line in worker.log_lines() if line.get("outcome") == "success"]
    assert [(line["task_id"], line["trace_id"]) for line in done] == [(sent.id, trace_id)]
    assert worker.stop() == 0, worker.log_tail()
    assert effect(client, prefix, "c1-202509110001") == 1
    assert not client.exists(KeySpace(prefix).queue(queue).dead)
    assert celery_app.AsyncResult(sent.id).state == "PENDING"  # Go writes no Celery result


@needs_node
def test_node_delayed_task_in_plus_0800_runs_on_celery_worker_on_time(
    interop: Interop, client: redis.Redis
) -> None:
    """2. Node schedules a task 2 s ahead in +08:00; the Celery worker's promoter runs it."""
    prefix, queue = interop.prefix, new_queue("py-delayed")
    worker = interop.celery_worker(queue)
    trace_id = f"trace-{uuid.uuid4().hex}"
    written = json.loads(interop.node.run(
        "produce", "--queue", queue, "--task-type", "interop.stamp",
        "--payload", '{"note": "due in 2 s"}', "--delay-ms", "2000", "--tz-offset", "+08:00",
        "--trace-id", trace_id, "--json"))
    task_id, due_ms = written["task_id"], int(written["due_ms"])
    schedule_time = parse_rfc3339(written["schedule_time"])
    assert schedule_time.utcoffset() == timedelta(hours=8)
    assert epoch_ms(schedule_time) == due_ms
    keys = KeySpace(prefix).queue(queue)
    assert client.zscore(keys.delayed, task_id) == due_ms  # waiting, in no stream yet
    assert not stream_envelopes(client, prefix, queue)

    stamp_key = f"{prefix}:probe:stamp:{task_id}"
    stamp = wait_for(lambda: client.hgetall(stamp_key), timeout=15, message=worker.log_tail)
    started_ms = int(stamp[b"started_ms"])  # Redis TIME, the clock promoters use
    assert started_ms >= due_ms, f"ran {due_ms - started_ms} ms early"
    assert started_ms <= due_ms + 3000, f"ran {started_ms - due_ms} ms late"
    assert stamp[b"trace_id"].decode() == trace_id  # task.request.trace_id

    worker.wait_for_log(f"interop.stamp[{task_id}] succeeded", timeout=10)
    lines = [line for line in worker.log_text().splitlines() if task_id in line]
    assert any("received" in line for line in lines), lines
    assert any("stamped" in line for line in lines), lines
    assert all(f"[trace_id={trace_id}]" in line for line in lines), lines
    wait_for(lambda: queue_is_drained(client, prefix, queue), timeout=5,
             message=worker.log_tail)


@needs_go
@needs_node
def test_node_dead_letter_matches_python_and_replays_on_go(
    interop: Interop, celery_app: Celery, client: redis.Redis
) -> None:
    """3. Node's exhausted test.fail: same fields as Python's; replayed, a Go worker runs it."""
    prefix = interop.prefix
    node_queue, py_queue = new_queue("node-fail"), new_queue("py-fail")
    node_worker = interop.node.worker(node_queue, "--backoff-ms", "200",
                                      "--max-backoff-ms", "1000", "--lease-ms", "3000")
    py_worker = interop.celery_worker(py_queue)
    node_task = interop.node.run("produce", "--queue", node_queue, "--task-type", "test.fail",
                                 "--payload", '{"n": 1}', "--max-retries", "2",
                                 "--retry-policy", "tiered").strip()
    py_task = celery_app.send_task("test.fail", kwargs={"n": 1}, queue=py_queue)

    tools = DeadLetters(client, Settings(key_prefix=prefix))
    [node_dead] = wait_for(lambda: tools.list([node_queue]), timeout=15,
                           message=node_worker.log_tail)
    [py_dead] = wait_for(lambda: tools.list([py_queue]), timeout=15,
                         message=py_worker.log_tail)
    assert {node_queue, py_queue} <= set(tools.queues())

    # The same failure fields, the same raw fields; only the values say who wrote them.
    assert set(node_dead.fields) == set(py_dead.fields), (
        set(node_dead.fields) ^ set(py_dead.fields))
    assert set(node_dead.raw) == set(py_dead.raw) == {"v", "enc", "body"}
    expected = {("node", node_task, "TestFailure", node_worker.proc.pid),
                ("python", py_task.id, "apps.interop_app.TestFailure", py_worker.pid)}
    seen = set()
    for dead in (node_dead, py_dead):
        fields, env = dead.fields, dead.envelope
        assert env is not None, dead.decode_error
        assert (dead.failure_class, dead.task_type) == ("task_error", "test.fail")
        assert fields["attempts"] == "3" and fields["dlq"] == "1"
        assert (env.retry_count, env.max_retries) == (2, 2)
        assert env.headers["x-first-failure-at"] == fields["first_failure_at"]
        assert parse_rfc3339(fields["first_failure_at"]) <= parse_rfc3339(
            fields["last_failure_at"]) <= parse_rfc3339(fields["dead_at"])
        assert "test.fail always fails" in fields["reason"]
        assert fields["traceback"]
        seen.add((fields["language"], dead.task_id, fields["exception_type"], int(fields["pid"])))
    assert seen == expected
    wait_for(lambda: py_task.state == "FAILURE", timeout=10, message=py_worker.log_tail)

    # Replay: ReplayEdit changes the payload and retry fields, never the task type or the
    # queue, so the entry goes back to its own queue, which a Go worker now consumes.
    assert node_worker.stop() == 0
    go_worker = interop.go(node_queue).worker()
    new_id = tools.replay(node_queue, node_dead.entry_id,
                          ReplayEdit(merge_patch={"replayed": True}, max_retries=0),
                          operator="interop-test")
    assert new_id is not None
    [go_dead] = wait_for(lambda: tools.list([node_queue]), timeout=10,
                         message=go_worker.log_tail)
    assert go_dead.entry_id != node_dead.entry_id
    assert go_dead.fields["language"] == "go"
    assert go_dead.fields["pid"] == str(go_worker.proc.pid)
    assert (go_dead.failure_class, go_dead.fields["attempts"]) == ("task_error", "1")
    # A Go error has no stack: the Go peer writes `traceback` for panics only (it is
    # optional, "when known", in docs/protocol.md section 7).
    assert set(go_dead.fields) | {"traceback"} == set(node_dead.fields)
    replayed = go_dead.envelope
    assert replayed is not None and node_dead.envelope is not None
    assert (replayed.task_id, replayed.trace_id) == (node_task, node_dead.envelope.trace_id)
    assert replayed.payload == {"n": 1, "replayed": True}  # the edit reached Go
    assert (replayed.retry_count, replayed.max_retries) == (0, 0)
    outcomes = [line.get("outcome") for line in go_worker.log_lines()
                if line.get("task_id") == node_task and line.get("outcome")]
    assert outcomes and set(outcomes) == {"dead"}, go_worker.log_tail()
    [(_, record)] = client.xrange(KeySpace(prefix).queue(node_queue).replayed)
    assert record[b"dead_id"].decode() == node_dead.entry_id
    assert record[b"new_id"].decode() == new_id
    assert record[b"operator"] == b"interop-test"
    wait_for(lambda: queue_is_drained(client, prefix, node_queue), timeout=5)
    assert go_worker.stop() == 0, go_worker.log_tail()


@needs_go
def test_same_idempotency_key_from_go_and_celery_has_its_effect_once(
    interop: Interop, celery_app: Celery, client: redis.Redis
) -> None:
    """4. One key per business action, published from Go and from Celery: one effect.

    A Go worker consumes ``go_queue`` and a Celery worker ``py_queue``; each key is
    published by Go to one queue and by Celery to the other, so each worker meets the
    other language's claim: done (a duplicate) or still running (deferred, then a
    duplicate). Then pairs race on ``shared``, which a second Go worker and the Celery
    worker both consume.
    """
    prefix = interop.prefix
    go_queue, py_queue, shared = new_queue("idem-go"), new_queue("idem-py"), new_queue("idem")
    go = interop.go(go_queue)
    go_worker = go.worker("--defer-ms", "300")
    go_shared = interop.go(shared)
    go_shared_worker = go_shared.worker("--defer-ms", "300")
    py_worker = interop.celery_worker(py_queue, shared)
    close_timeout = celery_app.tasks["order.close_timeout"]
    workers = (go_worker, go_shared_worker, py_worker)

    def from_go(peer: GoPeer, key: str) -> str:
        [task_id] = peer.produce("--task-type", "order.close_timeout", "--payload",
                                 json.dumps({"order_id": key, "store_id": 1}),
                                 "--idempotency-key", key)
        return task_id

    def from_celery(queue: str, key: str, **extra: Any) -> str:
        sent = close_timeout.apply_async(kwargs={"order_id": key, "store_id": 1, **extra},
                                         queue=queue, headers={"idempotency_key": key})
        return str(sent.id)

    def go_duplicates() -> set[str]:
        return {item.decode().split(":", 1)[1]
                for item in client.lrange(f"{prefix}:effects:duplicates", 0, -1)}

    def ran() -> dict[str, str]:
        """task_id -> language of every run."""
        return {task: language for language, task in
                (item.split(":", 1) for item in effects_log(client, prefix))}

    def wait(predicate: Callable[[], object]) -> None:
        wait_for(predicate, timeout=15, message=lambda: tails(*workers))

    def key_done_by(key: str, winner: str) -> bool:
        marker = client.get(f"{prefix}:idem:order.close_timeout:{key}")
        return marker is not None and marker.startswith(f"done {winner} ".encode())

    # Go publishes first; the Celery worker runs it; Celery's copy is a Go duplicate.
    k1 = f"k1-{uuid.uuid4().hex[:6]}"
    first = from_go(interop.go(py_queue), k1)
    wait(lambda: ran().get(first) == "py")
    second = from_celery(go_queue, k1)
    wait(lambda: second in go_duplicates())
    assert key_done_by(k1, first)

    # Celery publishes first; the Go worker runs it; Go's copy is a Celery duplicate.
    k2 = f"k2-{uuid.uuid4().hex[:6]}"
    first = from_celery(go_queue, k2)
    wait(lambda: ran().get(first) == "go")
    second = from_go(interop.go(py_queue), k2)
    wait(lambda: second in python_duplicates(py_worker))
    assert key_done_by(k2, first)

    # The Celery worker still runs the first copy: the Go worker finds the claim held by
    # a live Python consumer, defers its copy, and then finds the key done.
    k3 = f"k3-{uuid.uuid4().hex[:6]}"
    first = from_celery(py_queue, k3, hold_ms=1500)
    wait(lambda: client.get(f"{prefix}:probe:started:{k3}"))
    second = from_go(go, k3)
    wait(lambda: second in go_duplicates())
    assert ran().get(first) == "py" and key_done_by(k3, first)
    deferred = [line for line in go_worker.log_lines()
                if line.get("task_id") == second and "deferred" in str(line.get("msg"))]
    # A Celery worker's holder is "<consumer> <task_id> <entry id>" (protocol.md section 9).
    assert deferred and deferred[0]["holder"].split(" ")[1] == first, go_worker.log_tail()

    # Both languages' copies at once on one queue with a Go and a Celery worker.
    pairs = {}
    for n in range(3):
        key = f"k{4 + n}-{uuid.uuid4().hex[:6]}"
        pairs[key] = {from_go(go_shared, key), from_celery(shared, key)}
    everything = set().union(*pairs.values())
    wait(lambda: len(everything & (set(ran()) | go_duplicates()
                                   | set(python_duplicates(py_worker)))) == len(everything)
         and queue_is_drained(client, prefix, shared))
    for key, published in pairs.items():
        [winner] = published & set(ran())
        [loser] = published - {winner}
        assert loser in go_duplicates() | set(python_duplicates(py_worker)), key
        assert key_done_by(key, winner)

    for key in (k1, k2, k3, *pairs):
        assert effect(client, prefix, key) == 1, key
    assert len(ran()) == 3 + len(pairs)
    assert not go_duplicates() & set(python_duplicates(py_worker))
    for queue in (go_queue, py_queue, shared):
        assert queue_is_drained(client, prefix, queue)
        assert not client.exists(KeySpace(prefix).queue(queue).dead)
    assert py_worker.is_alive(), py_worker.log_tail()
    assert go_worker.stop() == 0, go_worker.log_tail()
    assert go_shared_worker.stop() == 0, go_shared_worker.log_tail()


#: What the Go peer's produce-malformed writes, as in tests/test_interop_go.py.
MALFORMED = {
    "badjson": {"v": b"1", "enc": b"json", "body": b'{"task_type": "order.close_timeout",'},
    "missingbody": {"v": b"1", "enc": b"json"},
    "badversion": {"v": b"99", "enc": b"json"},
    "badgzip": {"v": b"1", "enc": b"json+gzip"},
    "invalid": {"v": b"1", "enc": b"json"},
}


def malformed_kind(raw: dict[str, bytes]) -> str:
    """Which ``produce-malformed --kind`` wrote these raw fields."""
    if raw.get("v") == b"99":
        return "badversion"
    if raw.get("enc") == b"json+gzip":
        return "badgzip"
    if "body" not in raw:
        return "missingbody"
    return "invalid" if b"malformed-invalid" in raw["body"] else "badjson"


@contextmanager
def paused(*pids: int) -> Iterator[None]:
    """SIGSTOP the processes ``pids`` for the duration of the block (SIGCONT after)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@needs_go
@needs_node
def test_malformed_entries_stop_no_worker_of_any_language(
    interop: Interop, celery_app: Celery, client: redis.Redis
) -> None:
    """5. Malformed entries from Go, then valid tasks: Celery, Go and Node workers all go on.

    Three workers consume one queue. Who reads an entry is a race, so first each worker
    in turn is the only one awake (the two others are SIGSTOPped) while every kind of
    malformed entry and then a valid task arrive; then all three race for more.
    """
    prefix, queue = interop.prefix, new_queue("mixed")
    go = interop.go(queue)
    tools = DeadLetters(client, Settings(key_prefix=prefix))
    # Long leases: a paused worker must not look dead to the others.
    py_worker = interop.celery_worker(queue, lease_ms=20_000)
    go_worker = go.worker("--lease-ms", "20000")
    node_worker = interop.node.worker(queue, "--lease-ms", "20000", "--block-ms", "200")
    pids = {"python": py_worker.pid, "go": go_worker.proc.pid, "node": node_worker.proc.pid}
    tags = {"python": "py", "go": "go", "node": "node"}

    def alive() -> dict[str, bool]:
        return {"python": py_worker.is_alive(), "go": go_worker.alive(),
                "node": node_worker.proc.poll() is None}

    def publish_valid(order_id: str, by: str) -> None:
        payload = {"order_id": order_id, "store_id": 5}
        if by == "go":
            go.produce("--task-type", "order.close_timeout", "--payload", json.dumps(payload))
        elif by == "node":
            interop.node.run("produce", "--queue", queue, "--task-type", "order.close_timeout",
                             "--payload", json.dumps(payload))
        else:
            celery_app.send_task("order.close_timeout", kwargs=payload, queue=queue)

    def malformed_batch() -> None:
        for kind in MALFORMED:
            go.run("produce-malformed", "--kind", kind)

    workers = (py_worker, go_worker, node_worker)
    for language, pid in pids.items():
        dead_before = len(tools.list([queue], limit=1000))
        with paused(*(other for other in pids.values() if other != pid)):
            malformed_batch()
            publish_valid(f"alone-{language}", by=language)
            wait_for(lambda: effect(client, prefix, f"alone-{language}")  # noqa: B023
                     and queue_is_drained(client, prefix, queue), timeout=15,
                     message=lambda: f"{alive()}\n{tails(*workers)}")
        dead = tools.list([queue], limit=1000)[dead_before:]
        assert [entry.fields["language"] for entry in dead] == [language] * len(MALFORMED)
        assert effects_log(client, prefix)[-1].startswith(f"{tags[language]}:")
        assert all(alive().values()), alive()

    # All three awake: more malformed entries, then valid tasks from every language.
    malformed_batch()
    orders = [f"m-{language}-{n}" for language in pids for n in range(2)]
    for order_id in orders:
        publish_valid(order_id, by=order_id.split("-")[1])
    wait_for(lambda: all(effect(client, prefix, order_id) for order_id in orders)
             and queue_is_drained(client, prefix, queue), timeout=30,
             message=lambda: f"{alive()}\n{tails(*workers)}")
    assert [effect(client, prefix, order_id) for order_id in orders] == [1] * len(orders)
    assert len(effects_log(client, prefix)) == len(pids) + len(orders)

    dead = tools.list([queue], limit=1000)
    rounds = len(pids) + 1
    assert len(dead) == rounds * len(MALFORMED)
    kinds: Counter[str] = Counter()
    for entry in dead:
        kind = malformed_kind(entry.raw)
        kinds[kind] += 1
        assert entry.failure_class == "malformed_entry", kind
        assert entry.fields["queue"] == queue and entry.fields["reason"], kind
        assert entry.envelope is None and entry.decode_error, kind
        for name, value in MALFORMED[kind].items():  # the raw bytes, as written
            assert entry.raw[name] == value, (kind, name)
        assert ("body" in entry.raw) == (kind != "missingbody")
        with pytest.raises(MalformedEntry):
            decode_entry(entry.raw)
    assert kinds == Counter({kind: rounds for kind in MALFORMED})

    assert all(alive().values()), f"{alive()}\n{tails(*workers)}"
    assert py_worker.stop() == 0, py_worker.log_tail()
    assert go_worker.stop() == 0, go_worker.log_tail()
    assert node_worker.stop() == 0, node_worker.log_tail()
