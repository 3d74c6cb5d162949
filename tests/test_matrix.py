"""The cross-language matrix: every language produces and every language works.

Python (Celery), Go, Node.js and Java share one Redis and one key prefix for the module.
Each language runs one long-lived process that works one queue per scenario family,
``mx.<family>.<worker language>`` (see :mod:`support.matrix`); Python's is a real
``celery worker`` (Celery's defaults, late acknowledgement), its producer the same Celery
app in this process. A scenario publishes all of its pairs at once, producer language x
worker language, and waits for them together. The handler ``matrix.task`` records in
Redis which language ran which task and how often, so every scenario counts lost and
duplicated effects: zero of each is the only pass. Afterwards every queue it used is
drained: nothing left in a stream, pending or delayed.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
import redis
from apps.matrix_app import create_app
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from support import wait_for
from support.envelope_streams import envelope_url
from support.matrix import (
    LANGUAGES,
    LEASE_MS,
    CeleryPeer,
    JsonLinePeer,
    Launcher,
    Peer,
    Records,
    build_java_peer,
    queue_drained,
)
from support.monitor import Commands
from support.peers import GO, NODE, build_go_peer, node_unavailable
from support.spans import Span, max_overlap, spans
from support.workers import CeleryWorker

from kombu_envelope.dead_letter_entry import parse_dead_letter_fields
from kombu_envelope.keys import KeySpace
from kombu_envelope.settings import Settings
from kombu_envelope.store.delayed import DelayedTasks
from kombu_envelope.store.scripts import script
from kombu_envelope.store.slots import free_slot
from kombu_envelope.store.task_limits import Breaker, TaskLimit, TaskLimits
from kombu_envelope.testing.dispatcher import DispatcherProcess

MISSING = [tool for tool, found in (("go", GO), ("node", NODE), ("mvn", shutil.which("mvn")),
                                    ("java", shutil.which("java"))) if found is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING) or node_unavailable() is not None,
                       reason=f"the matrix needs every toolchain: missing {MISSING}, "
                              f"{node_unavailable() or 'node packages ok'}"),
    pytest.mark.timeout(300),
]

TASK = "matrix.task"
#: Scenario families worked by the long-lived process of every language.
FAMILIES = ("now", "delayed", "retry", "limits", "dead", "idem", "cancel", "expires", "result",
            "metrics", "trace")
#: How long a scenario may take to settle once published.
SETTLE_S = 40.0
#: How long a holding task keeps its worker busy while a scenario publishes behind it.
HOLD_MS = 3000
#: Who finishes the task of a language whose worker is killed (Celery workers consume the
#: queues they start with, so a Celery worker is never the one started later).
RESCUER = {"py": "go", "go": "node", "node": "java", "java": "go"}
PAIRS = [(producer, worker) for producer in LANGUAGES for worker in LANGUAGES]
#: How each language names itself in the dead-letter entries it writes.
DEAD_LETTER_LANGUAGE = {"py": "python", "go": "go", "node": "node", "java": "java"}


def other(language: str) -> str:
    """The next language after ``language``."""
    return LANGUAGES[(LANGUAGES.index(language) + 1) % len(LANGUAGES)]


@dataclass
class Matrix:
    """The module's processes, one per language, on one Redis and key prefix."""

    client: redis.Redis
    launch: Launcher
    celery_peer: CeleryPeer
    peers: dict[str, Peer]
    celery_worker: CeleryWorker
    records: Records = field(init=False)
    victims: list[JsonLinePeer | CeleryWorker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = Records(self.client, self.prefix)

    @property
    def prefix(self) -> str:
        return self.launch.prefix

    @property
    def celery_app(self) -> Celery:
        """The Celery app of the Python producer (a Celery caller of every scenario)."""
        return self.celery_peer.app

    @staticmethod
    def queue(family: str, worker: str) -> str:
        return f"mx.{family}.{worker}"

    def publish(self, plan: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Publish ``(producer, queue, task)`` triples: every peer is sent its commands
        (one per queue) before any answer is awaited."""
        batches: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for producer, queue, task in plan:
            batches[producer][queue].append({"task_type": TASK, **task})
        for producer, by_queue in batches.items():
            for queue, tasks in by_queue.items():
                self.peers[producer].send("publish", queue=queue, tasks=tasks)
        for producer, by_queue in batches.items():
            for queue, tasks in by_queue.items():
                ids = self.peers[producer].receive()["task_ids"]
                assert ids == [task["task_id"] for task in tasks], (producer, queue, ids)

    def dead_entries(self, queue: str) -> dict[str, dict[str, Any]]:
        """task_id -> the parsed fields of each dead-letter entry of ``queue``, with its id."""
        found = {}
        for entry_id, fields in self.client.xrange(KeySpace(self.prefix).queue(queue).dead):
            parsed = parse_dead_letter_fields(fields)
            if parsed.task_id is not None:
                found[parsed.task_id] = {"entry_id": entry_id.decode(), "fields": parsed}
        return found

    def logs(self) -> str:
        """Tails of every process's log, for failure messages."""
        parts = [f"--- celery worker\n{self.celery_worker.log_tail(3000)}"]
        for peer in [*self.peers.values(), *self.victims]:
            if isinstance(peer, JsonLinePeer):
                parts.append(f"--- {peer.language} peer\n{peer.log_tail(3000)}")
            elif isinstance(peer, CeleryWorker):
                parts.append(f"--- celery victim\n{peer.log_tail(3000)}")
        return "\n".join(parts)

    def expect_effects(self, expected: Mapping[str, str], timeout: float = SETTLE_S) -> None:
        """Each task id had exactly one effect, by the language given: none lost, none twice."""
        effects = self.records.wait_effects(expected, timeout, message=self.logs)
        wrong = {task_id: (language, effects[task_id]) for task_id, language in expected.items()
                 if effects[task_id] != [language]}
        assert not wrong, f"task_id -> (expected worker, effects): {wrong}"

    def assert_drained(self, *queues: str) -> None:
        wait_for(lambda: all(queue_drained(self.client, self.prefix, q) for q in queues),
                 timeout=10, message=lambda: f"not drained: {queues}\n{self.logs()}")


@pytest.fixture(scope="module")
def matrix(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    prefix = f"mx-{uuid.uuid4().hex[:8]}"
    # Made before the Go build's, which would otherwise race it to create the base temp dir.
    tmp = tmp_path_factory.mktemp("matrix")
    with ThreadPoolExecutor(2) as builds:
        go_build = builds.submit(build_go_peer, tmp_path_factory)
        java_build = builds.submit(build_java_peer)
        launch = Launcher(redis_url, prefix, tmp, go_build.result(), java_build.result())
    client = redis.Redis.from_url(redis_url)
    app = create_app(envelope_url(redis_url), redis_url, prefix, 3000)
    started: list[JsonLinePeer | CeleryWorker] = []
    victims: list[JsonLinePeer | CeleryWorker] = []
    try:
        celery_worker = launch.celery(*(Matrix.queue(f, "py") for f in FAMILIES))
        started.append(celery_worker)
        peers: dict[str, JsonLinePeer] = {}
        for language in ("go", "node", "java"):
            peers[language] = launch.peer(language, *(Matrix.queue(f, language) for f in FAMILIES))
            started.append(peers[language])
        celery_worker.wait_ready()
        for peer in peers.values():
            peer.wait_ready()
        celery_peer = CeleryPeer(app, client, prefix)
        yield Matrix(client, launch, celery_peer, {"py": celery_peer, **peers}, celery_worker,
                     victims=victims)
    finally:
        for process in [*started, *victims]:
            process.close()
        gc.collect()
        app.close()
        client.close()


def task_id(scenario: str, producer: str, worker: str) -> str:
    return f"{scenario}-{producer}-{worker}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ scenarios


def test_a_task_now(matrix: Matrix) -> None:
    plan, expected = [], {}
    for producer, worker in PAIRS:
        tid = task_id("now", producer, worker)
        plan.append((producer, matrix.queue("now", worker), {"task_id": tid}))
        expected[tid] = worker
    matrix.publish(plan)
    matrix.expect_effects(expected)
    matrix.assert_drained(*(matrix.queue("now", w) for w in LANGUAGES))


def chain_of(hops: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The ``then`` of a task after which ``(queue, task_id)`` hops run in turn (the last
    without a ``then``: an empty list would be one more level of nesting)."""
    then: list[dict[str, Any]] = []
    for queue, tid in reversed(hops):
        then = [{"queue": queue, "task_id": tid, **({"then": then} if then else {})}]
    return then


def test_one_trace_crosses_every_language(matrix: Matrix) -> None:
    """A chain from each first producer through the three other languages' workers (py ->
    go -> node -> java, rotated), each hop published by the previous hop's handler through
    its SDK's producer: without OpenTelemetry every hop is delivered the first producer's
    traceparent and tracestate unchanged, and the first task's trace_id (docs/protocol.md,
    section 18). Three hops is the longest chain whose nested ``then`` keeps the first
    payload within the default 5 levels of nesting (section 1, ``max_depth``)."""
    plan, expected, chains = [], {}, {}
    for producer in LANGUAGES:
        start = LANGUAGES.index(producer) + 1
        workers = [LANGUAGES[(start + n) % len(LANGUAGES)] for n in range(len(LANGUAGES) - 1)]
        hops = [(matrix.queue("trace", worker), task_id(f"trace{n}", producer, worker))
                for n, worker in enumerate(workers)]
        trace_id = uuid.uuid4().hex
        sent = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01",
                "tracestate": f"mx={producer},vendor=first"}
        (queue, first), *rest = hops
        plan.append((producer, queue, {"task_id": first, "headers": sent,
                                       "payload": {"then": chain_of(rest)}}))
        expected.update({tid: worker for (_, tid), worker in zip(hops, workers, strict=True)})
        chains[producer] = (sent, [tid for _, tid in hops])
    matrix.publish(plan)
    matrix.expect_effects(expected)
    traces = matrix.records.traces(expected)
    wrong = {}
    for producer, (sent, tids) in chains.items():
        first_trace_id = traces[tids[0]][0]["trace_id"] if traces[tids[0]] else None
        want = {**sent, "trace_id": first_trace_id}
        for tid in tids:
            seen = [{name: record[name] for name in want} | {"language": record["language"]}
                    for record in traces[tid]]
            if seen != [{**want, "language": expected[tid]}]:
                wrong[tid] = (producer, seen)
        assert first_trace_id == sent["traceparent"].split("-")[1], (
            f"{producer}: a task published with a traceparent and no trace_id takes the "
            f"traceparent's trace id, got {first_trace_id}")
    assert not wrong, f"task_id -> (first producer, trace headers delivered): {wrong}\n{chains}"
    matrix.assert_drained(*(matrix.queue("trace", w) for w in LANGUAGES))


def test_a_bad_then_is_dead_lettered_as_an_invalid_payload(matrix: Matrix) -> None:
    """A ``then`` task without a queue: every handler refuses the payload, naming the field."""
    plan, expected = [], {}
    for worker in LANGUAGES:
        tid = task_id("badthen", other(worker), worker)
        plan.append((other(worker), matrix.queue("trace", worker),
                     {"task_id": tid, "payload": {"then": [{"queue": "", "task_id": "x"}]}}))
        expected[tid] = worker

    def dead() -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for worker in LANGUAGES:
            found.update(matrix.dead_entries(matrix.queue("trace", worker)))
        return found

    matrix.publish(plan)
    wait_for(lambda: set(expected) <= set(dead()), timeout=SETTLE_S,
             message=lambda: f"not dead-lettered: {set(expected) - set(dead())}\n{matrix.logs()}")
    entries = {tid: entry["fields"] for tid, entry in dead().items() if tid in expected}
    wrong = {tid: (fields.failure_class.value, fields.reason) for tid, fields in entries.items()
             if (fields.failure_class.value, "payload.then" in fields.reason)
             != ("invalid_payload", True)}
    assert not wrong, f"task_id -> (failure_class, reason): {wrong}"
    assert not any(matrix.records.effects(expected).values())
    assert not matrix.client.exists(*(f"{matrix.prefix}:mx:attempts:{tid}" for tid in expected))
    matrix.assert_drained(*(matrix.queue("trace", w) for w in LANGUAGES))


def test_a_task_delayed_with_a_plus_0800_offset(matrix: Matrix) -> None:
    """Stored with its +08:00 offset, run once, never before it is due."""
    due = datetime.now(timezone(timedelta(hours=8))) + timedelta(seconds=3)
    schedule_time = due.isoformat(timespec="milliseconds")
    plan, expected = [], {}
    for producer, worker in PAIRS:
        tid = task_id("delayed", producer, worker)
        plan.append((producer, matrix.queue("delayed", worker),
                     {"task_id": tid, "schedule_time": schedule_time}))
        expected[tid] = worker
    matrix.publish(plan)
    delayed = DelayedTasks(matrix.client, Settings(key_prefix=matrix.prefix))
    offsets = {}
    for _, queue, task in plan:
        stored = delayed.get(task["task_id"], queue)
        assert stored is not None and stored.envelope is not None, (queue, task)
        assert stored.envelope.schedule_time is not None
        offsets[task["task_id"]] = stored.envelope.schedule_time.utcoffset()
    assert set(offsets.values()) == {timedelta(hours=8)}, offsets
    matrix.expect_effects(expected)
    due_ms = int(due.timestamp() * 1000)
    early = {tid: times for tid, times in matrix.records.effect_times(expected).items()
             if min(times) < due_ms}
    assert not early, f"ran before {schedule_time} ({due_ms}): {early}"
    matrix.assert_drained(*(matrix.queue("delayed", w) for w in LANGUAGES))


def test_retry_then_success(matrix: Matrix) -> None:
    """Two failures retried under the tiered policy, then one effect; retry_count 0, 1, 2."""
    plan, expected = [], {}
    for producer, worker in PAIRS:
        tid = task_id("retry", producer, worker)
        plan.append((producer, matrix.queue("retry", worker),
                     {"task_id": tid, "payload": {"fail_times": 2}, "retry_policy": "tiered"}))
        expected[tid] = worker
    matrix.publish(plan)
    matrix.expect_effects(expected)
    attempts = matrix.records.read("attempts", expected)
    wrong = {tid: got for tid, got in attempts.items()
             if got != [f"{expected[tid]}:{n}" for n in range(3)]}
    assert not wrong, wrong
    matrix.assert_drained(*(matrix.queue("retry", w) for w in LANGUAGES))


def test_max_retries_zero_and_null(matrix: Matrix) -> None:
    """0: the first failure is final (dead-lettered, attempts 1); null: no cap (5 attempts)."""
    plan, final, unlimited = [], {}, {}
    for producer, worker in PAIRS:
        queue = matrix.queue("limits", worker)
        zero, null = task_id("max0", producer, worker), task_id("maxnull", producer, worker)
        plan.append((producer, queue, {"task_id": zero, "payload": {"fail_times": 1},
                                       "retry_policy": "tiered", "max_retries": 0}))
        plan.append((producer, queue, {"task_id": null, "payload": {"fail_times": 4},
                                       "retry_policy": "tiered", "max_retries": None}))
        final[zero], unlimited[null] = worker, worker
    matrix.publish(plan)
    matrix.expect_effects(unlimited)

    def dead() -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for worker in LANGUAGES:
            found.update(matrix.dead_entries(matrix.queue("limits", worker)))
        return found

    wait_for(lambda: set(final) <= set(dead()), timeout=SETTLE_S,
             message=lambda: f"not dead-lettered: {set(final) - set(dead())}\n{matrix.logs()}")
    entries = dead()
    assert set(entries) == set(final), "only the max_retries 0 tasks are dead-lettered"
    got = {tid: (entries[tid]["fields"].failure_class.value, str(entries[tid]["fields"].attempts),
                 entries[tid]["fields"].language) for tid in final}
    wrong = {tid: seen for tid, seen in got.items()
             if seen != ("task_error", "1", DEAD_LETTER_LANGUAGE[final[tid]])}
    assert not wrong, f"task_id -> (failure_class, attempts, language): {wrong}"
    effects = matrix.records.effects(final)
    assert not any(effects.values()), effects
    attempts = matrix.records.read("attempts", [*final, *unlimited])
    wrong_attempts = {tid: got for tid, got in attempts.items()
                      if got != [f"{final.get(tid) or unlimited[tid]}:{n}"
                                 for n in range(1 if tid in final else 5)]}
    assert not wrong_attempts, wrong_attempts
    matrix.assert_drained(*(matrix.queue("limits", w) for w in LANGUAGES))


def test_dead_letter_then_replay_edited_by_another_language(matrix: Matrix) -> None:
    """A terminal failure is dead-lettered by the worker's language; another language's
    dead-letter API replays it with an edited payload, and the worker runs it once."""
    plan, expected, replayer = [], {}, {}
    for producer, worker in PAIRS:
        tid = task_id("dead", producer, worker)
        plan.append((producer, matrix.queue("dead", worker),
                     {"task_id": tid, "payload": {"fail": True}}))
        expected[tid] = worker
        # The replaying language: the producer's, or the next one when it is the worker's.
        replayer[tid] = producer if producer != worker else other(worker)
    matrix.publish(plan)

    def dead() -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for worker in LANGUAGES:
            found.update(matrix.dead_entries(matrix.queue("dead", worker)))
        return found

    wait_for(lambda: set(expected) <= set(dead()), timeout=SETTLE_S,
             message=lambda: f"not dead-lettered: {set(expected) - set(dead())}\n{matrix.logs()}")
    entries = dead()
    wrong = {tid: (entries[tid]["fields"].failure_class, entries[tid]["fields"].language)
             for tid, worker in expected.items()
             if (entries[tid]["fields"].failure_class, entries[tid]["fields"].language)
             != ("task_error", DEAD_LETTER_LANGUAGE[worker])}
    assert not wrong, f"task_id -> (failure_class, language): {wrong}"
    assert not any(matrix.records.effects(expected).values())
    # Without x-retry-policy the first failure is final, whoever produced the task.
    first_attempts = matrix.records.read("attempts", expected)

    for tid, worker in expected.items():
        matrix.peers[replayer[tid]].send("replay", queue=matrix.queue("dead", worker),
                                         entry_id=entries[tid]["entry_id"],
                                         payload={"fail": False, "edited": True})
    for tid in expected:
        assert matrix.peers[replayer[tid]].receive()["entry_id"], (tid, replayer[tid])
    matrix.expect_effects(expected)
    assert not dead(), "replayed entries leave the dead-letter stream"
    keys = KeySpace(matrix.prefix)
    replayed = sum(matrix.client.xlen(keys.queue(matrix.queue("dead", w)).replayed)
                   for w in LANGUAGES)
    assert replayed == len(PAIRS)
    matrix.assert_drained(*(matrix.queue("dead", w) for w in LANGUAGES))
    # A Celery caller of a replayed task gets the result of the run that ended it.
    app = matrix.celery_app
    results = {tid: app.AsyncResult(tid).get(timeout=10) for tid in expected
               if tid.startswith("dead-py-")}
    assert results == {tid: {"language": expected[tid]} for tid in results}, results
    retried = {tid: got for tid, got in first_attempts.items() if got != [f"{expected[tid]}:0"]}
    assert not retried, f"retried without x-retry-policy (task_id -> attempts): {retried}"


def test_one_idempotency_key_from_three_languages_has_one_effect(matrix: Matrix) -> None:
    """Per worker language, the three other languages publish one business key: one effect."""
    plan, by_worker = [], {}
    for worker in LANGUAGES:
        key = f"order-{worker}-{uuid.uuid4().hex[:8]}"
        ids = []
        for producer in LANGUAGES:
            if producer == worker:
                continue
            tid = task_id("idem", producer, worker)
            plan.append((producer, matrix.queue("idem", worker),
                         {"task_id": tid, "idempotency_key": key}))
            ids.append(tid)
        by_worker[worker] = (key, ids)
    matrix.publish(plan)
    queues = [matrix.queue("idem", w) for w in LANGUAGES]

    def settled() -> bool:
        effects = matrix.records.effects(tid for _, ids in by_worker.values() for tid in ids)
        return (all(sum(len(effects[tid]) for tid in ids) >= 1 for _, ids in by_worker.values())
                and all(queue_drained(matrix.client, matrix.prefix, q) for q in queues))

    wait_for(settled, timeout=SETTLE_S, interval=0.1, message=matrix.logs)
    effects = matrix.records.effects(tid for _, ids in by_worker.values() for tid in ids)
    app = matrix.celery_app
    for worker, (key, ids) in by_worker.items():
        ran = {tid: effects[tid] for tid in ids if effects[tid]}
        assert len(ran) == 1 and list(ran.values()) == [[worker]], (worker, key, effects)
        [winner] = ran
        marker = matrix.client.get(f"{matrix.prefix}:idem:{TASK}:{key}")
        assert marker is not None and marker.decode().startswith(f"done {winner} "), marker
        # The Celery caller's result: the handler's value, or null for a duplicate.
        [from_celery] = [tid for tid in ids if tid.startswith("idem-py-")] or [None]
        if from_celery is not None:
            result = app.AsyncResult(from_celery)
            assert result.get(timeout=10) == ({"language": worker} if from_celery == winner
                                              else None), (worker, from_celery, winner)
    assert not any(matrix.dead_entries(q) for q in queues)


def test_sigkill_mid_task_is_finished_by_another_language(matrix: Matrix) -> None:
    """Each language's worker is killed (SIGKILL) while it runs a task; after its lease
    runs out, a worker of another language takes the entry over and runs it: one effect."""
    victims = {}
    for language in LANGUAGES:
        queue = matrix.queue("kill", language)
        victims[language] = (matrix.launch.celery(queue) if language == "py"
                             else matrix.launch.peer(language, queue))
        matrix.victims.append(victims[language])
    for victim in victims.values():
        victim.wait_ready()
    plan, expected = [], {}
    for victim_language in LANGUAGES:
        tid = task_id("kill", RESCUER[victim_language], victim_language)
        plan.append((RESCUER[victim_language], matrix.queue("kill", victim_language),
                     {"task_id": tid, "payload": {"hold_ms": 1500}}))
        expected[tid] = RESCUER[victim_language]
    matrix.publish(plan)
    by_victim = dict(zip(LANGUAGES, expected, strict=True))

    def started() -> dict[str, list[str]]:
        return matrix.records.read("started", expected)

    wait_for(lambda: all(started()[tid] == [victim] for victim, tid in by_victim.items()),
             timeout=SETTLE_S, message=lambda: f"{started()}\n{matrix.logs()}")
    for victim in victims.values():
        victim.kill()
    for victim_language in LANGUAGES:
        matrix.peers[RESCUER[victim_language]].send("consume",
                                                    queue=matrix.queue("kill", victim_language))
    for victim_language in LANGUAGES:
        matrix.peers[RESCUER[victim_language]].receive()
    matrix.expect_effects(expected)
    assert started() == {tid: [victim, RESCUER[victim]] for victim, tid in by_victim.items()}
    matrix.assert_drained(*(matrix.queue("kill", w) for w in LANGUAGES))


def hold_every_worker(matrix: Matrix, family: str, hold_ms: int) -> dict[str, str]:
    """Give each worker language's queue of ``family`` a task that holds its worker for
    ``hold_ms``, so what is published next waits in the stream; wait until all started.
    Returns worker language -> the holding task's id."""
    plan, holders = [], {}
    for worker in LANGUAGES:
        tid = task_id(f"{family}-hold", worker, worker)
        plan.append((worker, matrix.queue(family, worker),
                     {"task_id": tid, "payload": {"hold_ms": hold_ms}}))
        holders[worker] = tid
    matrix.publish(plan)
    wait_for(lambda: all(matrix.records.read("started", holders.values()).values()),
             timeout=SETTLE_S, message=matrix.logs)
    return holders


def test_cancel_a_queued_and_a_delayed_task(matrix: Matrix) -> None:
    """Each producer language cancels (Celery: ``revoke()``) one task waiting in a stream
    and one delayed task of every worker language, knowing only their ids: neither runs.
    Tasks published after them run; nothing is dead-lettered."""
    holders = hold_every_worker(matrix, "cancel", HOLD_MS)
    # Far enough ahead that every language's cancel finds it still delayed on a busy machine.
    due = datetime.now(timezone.utc) + timedelta(seconds=6)
    plan, queued, delayed, after = [], {}, {}, {}
    for producer, worker in PAIRS:
        queue = matrix.queue("cancel", worker)
        now_id, later_id = task_id("queued", producer, worker), task_id("later", producer, worker)
        plan.append((producer, queue, {"task_id": now_id}))
        plan.append((producer, queue, {"task_id": later_id, "schedule_time": due.isoformat()}))
        queued[now_id], delayed[later_id] = (producer, queue), (producer, queue)
    matrix.publish(plan)
    for producer in LANGUAGES:
        ids = [tid for tid, (p, _) in [*queued.items(), *delayed.items()] if p == producer]
        matrix.peers[producer].send("cancel", task_ids=ids)
    outcomes = {}
    for producer in LANGUAGES:
        ids = [tid for tid, (p, _) in [*queued.items(), *delayed.items()] if p == producer]
        answer = matrix.peers[producer].receive()["outcomes"]
        outcomes.update(zip(ids, answer, strict=True))
    cancelled_ms = int(time.time() * 1000)
    expected_outcomes = {
        **{tid: {"outcome": "marked", "queue": None} for tid in queued},
        **{tid: {"outcome": "removed", "queue": queue} for tid, (_, queue) in delayed.items()},
    }
    # Celery's revoke() answers nothing: its effect is checked below, like everyone's.
    wrong = {tid: got for tid, got in outcomes.items()
             if got["outcome"] is not None and got != expected_outcomes[tid]}
    assert not wrong, f"task_id -> cancel outcome: {wrong}"
    plan = []
    for producer, worker in PAIRS:
        tid = task_id("after", producer, worker)
        plan.append((producer, matrix.queue("cancel", worker), {"task_id": tid}))
        after[tid] = worker
    matrix.publish(plan)
    matrix.expect_effects({**after, **{tid: w for w, tid in holders.items()}})
    released = matrix.records.effect_times(holders.values())
    assert all(times[0] >= cancelled_ms for times in released.values()), (
        f"a holding task ended before every cancel was answered at {cancelled_ms}: {released}")
    wait_for(lambda: datetime.now(timezone.utc) > due + timedelta(seconds=1), timeout=10)
    cancelled = [*queued, *delayed]
    ran = {tid: got for tid, got in matrix.records.read("attempts", cancelled).items() if got}
    assert not ran, f"cancelled tasks that ran: {ran}"
    queues = [matrix.queue("cancel", w) for w in LANGUAGES]
    matrix.assert_drained(*queues)
    assert not any(matrix.dead_entries(q) for q in queues)
    assert_revoked(matrix, [tid for tid, (producer, _) in queued.items() if producer == "py"])


def test_expires(matrix: Matrix) -> None:
    """A task whose ``expires`` passes while it waits in a stream, or before it is due, is
    acknowledged without running, by every worker language; one that has not expired runs."""
    holders = hold_every_worker(matrix, "expires", HOLD_MS)
    plus8 = timezone(timedelta(hours=8))
    now = datetime.now(plus8)
    soon, later = now + timedelta(milliseconds=HOLD_MS // 2), now + timedelta(seconds=60)
    plan, expired, live = [], [], {}
    for producer, worker in PAIRS:
        queue = matrix.queue("expires", worker)
        waiting, delayed, fresh = (task_id(name, producer, worker)
                                   for name in ("expired", "expired-delayed", "fresh"))
        plan.append((producer, queue, {"task_id": waiting, "expires": soon.isoformat()}))
        plan.append((producer, queue, {"task_id": delayed, "expires": soon.isoformat(),
                                       "schedule_time": (soon + timedelta(seconds=1)).isoformat()}))
        plan.append((producer, queue, {"task_id": fresh, "expires": later.isoformat()}))
        expired += [waiting, delayed]
        live[fresh] = worker
    matrix.publish(plan)
    assert datetime.now(plus8) < soon, "published too slowly to expire while waiting"
    matrix.expect_effects({**live, **{tid: w for w, tid in holders.items()}})
    queues = [matrix.queue("expires", w) for w in LANGUAGES]
    matrix.assert_drained(*queues)
    ran = {tid: got for tid, got in matrix.records.read("attempts", expired).items() if got}
    assert not ran, f"expired tasks that ran: {ran}"
    assert not any(matrix.dead_entries(q) for q in queues)
    assert_revoked(matrix, [tid for tid in expired if tid.startswith("expired-py-")])


def assert_revoked(matrix: Matrix, task_ids: list[str]) -> None:
    """The Celery caller of each task sees it ``REVOKED`` (written by whichever worker
    language acknowledged it without running it)."""
    app = matrix.celery_app
    states = {tid: app.AsyncResult(tid).state for tid in task_ids}
    assert set(states.values()) == {"REVOKED"}, states


def test_celery_async_result_get_of_a_task_run_in_each_language(matrix: Matrix) -> None:
    """A Celery caller's ``AsyncResult.get()`` returns what the handler of each worker
    language returned, and raises the handler's error for a task that failed."""
    app = matrix.celery_app
    sent = {}
    for worker in LANGUAGES:
        queue = matrix.queue("result", worker)
        ok = app.send_task(TASK, kwargs={}, queue=queue, task_id=task_id("ok", "py", worker))
        failed = app.send_task(TASK, kwargs={"fail": True}, queue=queue,
                               task_id=task_id("failed", "py", worker))
        sent[worker] = (ok, failed)
    for worker, (ok, failed) in sent.items():
        assert ok.get(timeout=SETTLE_S) == {"language": worker}, worker
        with pytest.raises(Exception) as caught:
            failed.get(timeout=SETTLE_S)
        assert type(caught.value).__name__.endswith("MatrixFailure"), (worker, caught.value)
        assert "matrix.task failed attempt" in str(caught.value), (worker, caught.value)
        assert failed.state == "FAILURE"
    matrix.assert_drained(*(matrix.queue("result", w) for w in LANGUAGES))


def test_the_dispatcher_reports_the_state_of_a_task_run_in_each_language(
        matrix: Matrix, redis_url: str) -> None:
    """Posted through the dispatcher, run by each language's worker: ``GET /tasks/{id}``
    answers from the task record that worker wrote (docs/protocol.md, section 14), and
    the dispatcher accepts the task because that worker announced it serves it
    (section 15)."""
    with DispatcherProcess(redis_url, options={"key_prefix": matrix.prefix}) as dispatcher:
        expected = {}
        for worker in LANGUAGES:
            tid = task_id("state", "http", worker)
            posted = httpx.post(f"{dispatcher.url}/tasks",
                                params={"queue": matrix.queue("now", worker)},
                                json={"task_id": tid, "task_type": TASK, "payload": {}},
                                timeout=10)
            assert posted.status_code == 201, posted.text
            expected[tid] = worker
        matrix.expect_effects(expected)
        for tid, worker in expected.items():
            def succeeded(tid: str = tid) -> dict[str, Any] | None:
                state = httpx.get(f"{dispatcher.url}/tasks/{tid}", timeout=10).json()
                return state if state["state"] == "succeeded" else None
            state = wait_for(succeeded, timeout=10, message=matrix.logs)
            assert state["language"] == DEAD_LETTER_LANGUAGE[worker], state
            assert state["queue"] == matrix.queue("now", worker)
            assert state["attempts"] == 1 and state["worker"], state
            assert state["started_at"] and state["finished_at"], state


def metric_values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of a Prometheus text page."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_of_a_known_workload_run_in_each_language(
        matrix: Matrix, redis_url: str) -> None:
    """Every producer sends each worker language the same workload; the dispatcher's
    ``GET /metrics`` (docs/protocol.md, section 17: the statistics every worker writes)
    then counts exactly that, per queue, task type and language."""
    plan, firsts = [], []
    for producer, worker in PAIRS:
        queue, key = matrix.queue("metrics", worker), f"m-{producer}-{uuid.uuid4().hex[:8]}"
        first = {"task_id": task_id("m-idem", producer, worker), "idempotency_key": key}
        plan += [
            (producer, queue, {"task_id": task_id("m-ok", producer, worker)}),
            (producer, queue, {"task_id": task_id("m-retry", producer, worker),
                               "payload": {"fail_times": 1}, "retry_policy": "tiered"}),
            (producer, queue, {"task_id": task_id("m-dead", producer, worker),
                               "payload": {"fail": True}, "max_retries": 0}),
            (producer, queue, first),
        ]
        firsts.append((producer, queue, worker, first))
    matrix.publish(plan)
    # The second task of each key goes once the first ran: it is skipped, not deferred.
    matrix.records.wait_effects([first["task_id"] for *_, first in firsts], SETTLE_S,
                                message=matrix.logs)
    matrix.publish([(producer, queue, {**first, "task_id": task_id("m-dup", producer, worker)})
                    for producer, queue, worker, first in firsts])
    each = len(LANGUAGES)  # tasks of each kind sent to one worker language
    counters = {"succeeded": 3 * each, "failed": 2 * each, "retried": each,
                "dead_lettered": each, "duplicates_skipped": each}
    ran = 5 * each  # attempts that ran: the successes and the failures
    want = {worker: {**{f"kombu_envelope_tasks_{name}_total": n for name, n in counters.items()},
                     "kombu_envelope_task_run_duration_seconds_count": ran,
                     "kombu_envelope_task_start_delay_seconds_count": ran,
                     "kombu_envelope_workers": 1, "kombu_envelope_queue_dead_letters": each}
            for worker in LANGUAGES}

    def labels(name: str, worker: str) -> frozenset[tuple[str, str]]:
        found = {"queue": matrix.queue("metrics", worker)}
        if not name.startswith("kombu_envelope_queue_"):
            found["language"] = DEAD_LETTER_LANGUAGE[worker]
        if name.startswith("kombu_envelope_task"):
            found["task_type"] = TASK
        return frozenset(found.items())

    with DispatcherProcess(redis_url, options={"key_prefix": matrix.prefix}) as dispatcher:
        def counted() -> dict[str, dict[str, float]]:
            page = httpx.get(f"{dispatcher.url}/metrics", timeout=10)
            assert page.status_code == 200, page.text
            values = metric_values(page.text)
            return {worker: {name: values.get((name, labels(name, worker)), 0.0)
                             for name in want[worker]} for worker in LANGUAGES}

        queues = [matrix.queue("metrics", worker) for worker in LANGUAGES]
        wait_for(lambda: all(queue_drained(matrix.client, matrix.prefix, q) for q in queues)
                 and counted() == want, timeout=SETTLE_S,
                 message=lambda: f"counted {counted()}\nwanted {want}\n{matrix.logs()}")


# ------------------------------------------------------------- limits (protocol section 19)

#: Processes each language runs on a limited queue, and tasks each may run at once.
LIMITED_CONCURRENCY = 2
#: How long each task of the rate drill runs. The rate (20/s) does not say which consumer
#: gets each token: the first to ask after it comes, and that is mostly the one whose timer
#: is the most punctual. Tasks this long keep the winners busy: three languages' slots
#: (2 each) start at most 3 x 2 / 0.3 = 20 a second, less their overhead, so every language
#: takes part; four start up to 26.7 a second, so the rate, not the slots, sets the pace
#: (without it the 61 starts would span about 2.2 s, not 3).
RATE_TASK_MS = 300
#: The long version of the rate drill (``KOMBU_ENVELOPE_LONG_DRILLS=1``): a minute.
LONG_DRILLS = os.environ.get("KOMBU_ENVELOPE_LONG_DRILLS") == "1"


def limited_queue(matrix: Matrix, limit: TaskLimit, task_type: str = "limits.task"
                  ) -> tuple[str, dict[str, JsonLinePeer | CeleryWorker]]:
    """A fresh queue whose ``task_type`` has ``limit``, and its workers by language: every
    language works it (each with :data:`LIMITED_CONCURRENCY`), all of them ready."""
    queue = f"mx.caps.{uuid.uuid4().hex[:6]}"
    TaskLimits(matrix.client, Settings(key_prefix=matrix.prefix)).set(queue, task_type, limit)
    return queue, worked_by_all(matrix, queue)


def worked_by_all(matrix: Matrix, queue: str) -> dict[str, JsonLinePeer | CeleryWorker]:
    """Workers of every language on ``queue`` (each with :data:`LIMITED_CONCURRENCY`), by
    language, all of them ready."""
    workers: dict[str, JsonLinePeer | CeleryWorker] = {
        "py": matrix.launch.celery(queue, concurrency=LIMITED_CONCURRENCY),
        **{language: matrix.launch.peer(language, queue, concurrency=LIMITED_CONCURRENCY)
           for language in ("go", "node", "java")}}
    matrix.victims.extend(workers.values())
    for worker in workers.values():
        worker.wait_ready()
    return workers


def holds_slot(matrix: Matrix, running: str, peer: JsonLinePeer) -> bool:
    """Whether an entry pending to a consumer of ``peer``'s process holds a slot now."""
    for member in matrix.client.zrange(running, 0, -1):
        stream, entry_id = member.decode().split(" ")
        owner = matrix.client.xpending_range(stream, Settings().consumer_group, entry_id,
                                             entry_id, 1)
        if owner and f"-{peer.proc.pid}-" in owner[0]["consumer"].decode():
            return True
    return False


def publish_limited(matrix: Matrix, queue: str, count: int, sleep_ms: int) -> list[str]:
    """``count`` ``limits.task`` published to ``queue`` by the four languages in turn."""
    plan = []
    for index in range(count):
        producer = LANGUAGES[index % len(LANGUAGES)]
        plan.append((producer, queue, {"task_id": task_id("caps", producer, "any"),
                                       "task_type": "limits.task",
                                       "payload": {"sleep_ms": sleep_ms}}))
    matrix.publish(plan)
    return [task["task_id"] for _producer, _queue, task in plan]


def wait_spans(matrix: Matrix, ids: list[str], timeout: float) -> list[Span]:
    """The spans of ``ids`` once every one of them ran."""
    wanted = set(ids)

    def ran() -> list[Span] | None:
        found = [s for s in spans(matrix.client, matrix.prefix) if s.task_id in wanted]
        return found if {s.task_id for s in found} == wanted else None

    return wait_for(ran, timeout=timeout, interval=0.1, message=matrix.logs)


def test_a_concurrency_cap_holds_across_every_language_and_a_killed_worker(
        matrix: Matrix) -> None:
    """``limits.task`` capped at 3 on a queue every language works (8 processes' worth):
    sampled and from the spans, never more than 3 at once; a worker SIGKILLed while it
    holds slots gives them back after its lease, and every task runs exactly once."""
    queue, workers = limited_queue(matrix, TaskLimit(concurrency=3))
    running = KeySpace(matrix.prefix).queue(queue).running("limits.task")
    samples: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append(int(matrix.client.zcard(running)))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        ids = publish_limited(matrix, queue, 48, sleep_ms=150)
        victim = workers["go"]
        assert isinstance(victim, JsonLinePeer)
        # Killed once it has run some and holds a slot (the Go peer's entries are its own).
        wait_for(lambda: sum(s.language == "go" for s in spans(matrix.client, matrix.prefix))
                 >= 2 and holds_slot(matrix, running, victim), timeout=SETTLE_S,
                 interval=0.005, message=matrix.logs)
        victim.kill()
        ran = wait_spans(matrix, ids, timeout=SETTLE_S)
    finally:
        sampling.set()
        sampler.join(5)
    assert max(samples) <= 3 and max_overlap(ran) <= 3, (max(samples), max_overlap(ran))
    assert max_overlap(ran) == 3  # the cap is reached, not merely respected
    assert len(ran) == len(ids)  # each task once: none lost with the killed worker, none twice
    assert len({s.language for s in ran}) == 4, {s.language for s in ran}
    wait_for(lambda: queue_drained(matrix.client, matrix.prefix, queue)
             and not matrix.client.zcard(running), timeout=10, message=matrix.logs)


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_freed_slot_wakes_and_is_announced_by_every_language(
        matrix: Matrix, language: str) -> None:
    """One worker of ``language`` on a queue whose ``limits.task`` has one slot (section 19,
    "Waking on a freed slot"). While its task waits for a slot another process holds, its
    blocking wait has the queue's slot-freed stream in it, from the id read.lua answered
    (seen with MONITOR); that process's settle frees the slot and the task runs. While a
    task of its own holds the slot and another waits for it, its settle appends
    ``t limits.task`` to slot-freed. Each task runs once."""
    queue = f"mx.wake.{uuid.uuid4().hex[:6]}"
    settings = Settings(key_prefix=matrix.prefix)
    TaskLimits(matrix.client, settings).set(queue, "limits.task", TaskLimit(concurrency=1))
    keys = KeySpace(matrix.prefix).queue(queue)
    running = keys.running("limits.task")
    matrix.client.zadd(running, {"another worker": 2**50})
    with Commands(matrix.launch.redis_url, lambda c: keys.slot_freed in c) as seen:
        worker = (matrix.launch.celery(queue) if language == "py"
                  else matrix.launch.peer(language, queue))
        matrix.victims.append(worker)
        worker.wait_ready()
        first = publish_limited(matrix, queue, 1, sleep_ms=0)
        wait = seen.wait(lambda c: c.upper().startswith("XREAD "), message=matrix.logs)
        ((created, _fields),) = matrix.client.xrange(keys.slot_freed)  # by read.lua, parking it
        assert wait.split()[-1] == created.decode(), wait
        pipe = matrix.client.pipeline(transaction=True)
        free_slot(pipe, running, "another worker")  # as the other process's settle frees it
        pipe.execute()
        wait_spans(matrix, first, timeout=SETTLE_S)
        wait_for(lambda: queue_drained(matrix.client, matrix.prefix, queue)
                 and not matrix.client.zcard(running), timeout=10, message=matrix.logs)
        holding = publish_limited(matrix, queue, 1, sleep_ms=1500)
        wait_for(lambda: matrix.client.zcard(running), timeout=SETTLE_S, message=matrix.logs)
        parked = publish_limited(matrix, queue, 1, sleep_ms=0)
        before = len(seen.seen)
        # Read as a consumer with room for one: the task waits for the held slot.
        reply = script(matrix.client, "read")(keys=list(keys.task_streams), args=[
            settings.consumer_group, "probe", 1, LEASE_MS, 1])
        assert reply[0] == [] and reply[3], reply
        # Nobody but the worker frees a slot now.
        seen.wait(lambda c: c.upper().startswith("XADD ") and c.endswith(" t limits.task"),
                  after=before, message=matrix.logs)
        ran = wait_spans(matrix, first + holding + parked, timeout=SETTLE_S)
    assert sorted(s.task_id for s in ran) == sorted(first + holding + parked)
    assert {s.language for s in ran} == {language}
    wait_for(lambda: queue_drained(matrix.client, matrix.prefix, queue)
             and not matrix.client.zcard(running), timeout=10, message=matrix.logs)


@pytest.mark.parametrize("seconds", [
    3, pytest.param(60, marks=pytest.mark.skipif(not LONG_DRILLS, reason="a long drill: set "
                                                 "KOMBU_ENVELOPE_LONG_DRILLS=1"))])
def test_a_rate_holds_across_every_language(matrix: Matrix, seconds: int) -> None:
    """``limits.task`` at 20 starts a second on a queue every language works: the starts of
    ``20 * seconds`` tasks span ``seconds`` within 10 %."""
    queue, _workers = limited_queue(matrix, TaskLimit(rate=20))
    ids = publish_limited(matrix, queue, 20 * seconds + 1, sleep_ms=RATE_TASK_MS)
    ran = wait_spans(matrix, ids, timeout=seconds * 1.5 + SETTLE_S)
    starts = sorted(s.start_ms for s in ran)
    span_s = (starts[-1] - starts[0]) / 1000
    # Within 10 %; over the 3 s smoke run, plus the 0.5 s a loaded machine may take to get
    # one start going (one late start stretches a short span past 10 %).
    slack_s = 0.5 if seconds < 10 else 0.0
    assert seconds * 0.9 <= span_s <= seconds * 1.1 + slack_s, span_s
    assert len({s.language for s in ran}) == 4, {s.language for s in ran}


def test_a_breaker_opens_on_failures_in_every_language_and_closes_on_a_probe(
        matrix: Matrix) -> None:
    """``matrix.task`` with a circuit breaker on a queue every language works: failures
    counted by all four open it, nothing starts during its cool-down, then one probe runs
    and its success closes it for the rest."""
    cooldown_s = 3.0
    breaker = Breaker(failure_ratio=0.5, min_attempts=4, window_s=30, cooldown_s=cooldown_s)
    queue, _workers = limited_queue(matrix, TaskLimit(breaker=breaker), task_type=TASK)
    limits = TaskLimits(matrix.client, Settings(key_prefix=matrix.prefix))
    failing = [(LANGUAGES[i % 4], queue, {"task_id": task_id("brk-fail", LANGUAGES[i % 4], "any"),
                                          "payload": {"fail": True}}) for i in range(12)]
    matrix.publish(failing)
    wait_for(lambda: limits.breaker_state(queue, TASK) == "open", timeout=SETTLE_S,
             message=matrix.logs)
    since = float(matrix.client.hget(KeySpace(matrix.prefix).queue(queue).breaker(TASK),
                                      "since"))
    healthy = [(LANGUAGES[i % 4], queue, {"task_id": task_id("brk-ok", LANGUAGES[i % 4], "any")})
               for i in range(6)]
    matrix.publish(healthy)
    ids = [task["task_id"] for _p, _q, task in healthy]
    matrix.records.wait_effects(ids, timeout=SETTLE_S + cooldown_s, message=matrix.logs)
    times = sorted(t for tid, ts in matrix.records.effect_times(ids).items() for t in ts)
    assert len(times) == len(ids)  # each once
    assert times[0] >= since + cooldown_s * 1000 - 50  # nothing during the cool-down
    assert limits.breaker_state(queue, TASK) == "closed"
    # The failures that opened it were counted by every language's worker (section 17).
    stats = matrix.client.hgetall(KeySpace(matrix.prefix).queue(queue).stats)
    failed_by = {name.decode().split(" ")[1] for name, count in stats.items()
                 if name.decode().endswith(" failed") and int(count) > 0}
    assert len(failed_by) >= 3, failed_by


@pytest.mark.parametrize("tasks,keys", [
    (800, 40), pytest.param(10_000, 500, marks=pytest.mark.skipif(
        not LONG_DRILLS, reason="a long drill: set KOMBU_ENVELOPE_LONG_DRILLS=1"))])
def test_ordering_keys_hold_across_every_language_with_failures_and_a_kill(
        matrix: Matrix, tasks: int, keys: int) -> None:
    """``tasks`` ``matrix.task`` over ``keys`` ordering keys (docs/protocol.md, section 20)
    on a queue every language works, each key published by one language in turn, one task
    in ten failing once (retried under the tiered policy), the Go worker SIGKILLed mid-run:
    per key, every task ran alone and in publish order (from the key's log of starts and
    ends), and each had its effect once, but for the killed worker's unsettled ones."""
    queue = f"mx.order.{uuid.uuid4().hex[:6]}"
    workers = worked_by_all(matrix, queue)
    rng = random.Random(20)
    order: dict[str, list[str]] = {f"{queue}-k{k}": [] for k in range(keys)}
    plan = []
    for index in range(tasks):
        key = f"{queue}-k{index % keys}"
        producer = LANGUAGES[(index % keys) % len(LANGUAGES)]
        tid = task_id("order", producer, "any")
        order[key].append(tid)
        plan.append((producer, queue, {
            "task_id": tid, "ordering_key": key, "idempotency_key": tid,
            "retry_policy": "tiered",
            "payload": {"log": key, "hold_ms": 10,
                        "fail_times": 1 if rng.random() < 0.1 else 0}}))
    matrix.publish(plan)
    victim = workers["go"]
    assert isinstance(victim, JsonLinePeer)
    all_ids = [t for ids in order.values() for t in ids]

    def go_is_busy() -> bool:  # it has had effects and works on: killed mid-run
        done = [langs for langs in matrix.records.effects(all_ids).values() if langs]
        return len(done) >= tasks // 20 and any("go" in langs for langs in done)

    wait_for(go_is_busy, timeout=SETTLE_S, interval=0.05, message=matrix.logs)
    victim.kill()

    def ended() -> dict[str, list[str]] | None:
        logs = {key: [e.decode() for e in matrix.client.lrange(f"{matrix.prefix}:mx:log:{key}",
                                                                0, -1)]
                for key in order}
        done = {e for entries in logs.values() for e in entries if e.startswith("end ")}
        return logs if len(done) >= tasks else None

    logs = wait_for(ended, timeout=SETTLE_S + tasks / 50, interval=0.5, message=matrix.logs)
    effects = matrix.records.effects(all_ids)
    attempts = matrix.records.read("attempts", all_ids)
    # A task the killed worker ran to its end but had not settled runs again, still in its
    # turn: the at-least-once window between an effect and its done marker. Its key's log
    # shows it starting again after its end; the effect may or may not have been recorded.
    again = {tid for entries in logs.values() for at, entry in enumerate(entries)
             if entry.startswith("end ") and f"start {(tid := entry[4:])}" in entries[at + 1:]}
    assert len(again) <= LIMITED_CONCURRENCY, again
    assert all(any(a.startswith("go:") for a in attempts[t]) for t in again), \
        {t: attempts[t] for t in again}
    assert all(len(effects[t]) == 1 or effects[t] == ["go", effects[t][1]] for t in again), \
        {t: effects[t] for t in again}
    assert all(len(langs) == 1 for t, langs in effects.items() if t not in again), \
        {t: langs for t, langs in effects.items() if len(langs) != 1}
    wrong = {}
    for key, entries in logs.items():
        expected, at = order[key], 0
        for entry in entries:
            what, tid = entry.split(" ", 1)
            if at and tid == expected[at - 1] and tid in again:
                continue  # its run again, before the next task of its key started
            if at >= len(expected) or tid != expected[at]:
                wrong[key] = {"out of turn": entry, "log": entries, "publish order": expected}
                break
            at += what == "end"
    assert not wrong, f"keys whose log breaks their publish order: {wrong}"
    wait_for(lambda: queue_drained(matrix.client, matrix.prefix, queue), timeout=10,
             message=matrix.logs)
