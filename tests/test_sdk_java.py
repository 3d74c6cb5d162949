"""The Java SDK (sdk/java): its own Maven build and tests, then Python ↔ Java on one Redis.

``mvn verify`` runs the SDK's JUnit suite: every conformance vector, and producer → worker
round trips against a private redis-server that the Java tests start themselves (the same
binary the Python suite uses). It runs offline when the Maven repository already holds every
artifact (CI resolves them first, see .ci/run), otherwise online. Skipped without ``mvn`` or
``java``, like the Go and Node interop tests without their toolchains. The cross-language
tests run ``InteropWorker`` and ``InteropProducer`` from the SDK's test classes: Python publishes
and a Java worker runs (and dead-letters what Python's tools then read); Java publishes and
Python decodes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from support.workers import PROJECT_ROOT

from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.codec import decode_entry
from kombu_envelope.dead_letter_entry import parse_dead_letter_fields
from kombu_envelope.keys import KeySpace
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.delayed import DelayedTasks
from kombu_envelope.testing.redis_server import find_redis_server_binary

MVN = shutil.which("mvn")
JAVA = shutil.which("java")
JAVA_DIR = PROJECT_ROOT / "sdk" / "java"
#: A warm `mvn -o verify` takes a few minutes beside the rest of the suite (TLS, Sentinel and
#: Cluster groups of its own); a first, online run also downloads the dependencies.
MAVEN_TIMEOUT_S = 480
OFFLINE_MISSES = ("offline mode", "has not been downloaded", "Cannot access central")

pytestmark = [
    pytest.mark.skipif(MVN is None or JAVA is None,
                       reason="Maven (`mvn`) or `java` is not on PATH"),
    pytest.mark.timeout(2 * MAVEN_TIMEOUT_S + 60),
]


def maven(*args: str) -> subprocess.CompletedProcess[str]:
    """Run Maven in sdk/java offline, or online when the local repository lacks something."""
    assert MVN is not None
    redis_server = f"-Dkombuenvelope.redis.server={find_redis_server_binary()}"
    command = [MVN, "-q", "-B", redis_server, *args]
    done = subprocess.run([*command[:3], "-o", *command[3:]], cwd=JAVA_DIR, capture_output=True,
                          text=True, timeout=MAVEN_TIMEOUT_S, check=False)
    if done.returncode != 0 and any(m in done.stdout + done.stderr for m in OFFLINE_MISSES):
        done = subprocess.run(command, cwd=JAVA_DIR, capture_output=True, text=True,
                              timeout=MAVEN_TIMEOUT_S, check=False)
    return done


def surefire_counts() -> dict[str, int]:
    """Totals of the surefire XML reports of the last run."""
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in (JAVA_DIR / "target" / "surefire-reports").glob("TEST-*.xml"):
        suite = ET.parse(report).getroot()
        for name in totals:
            totals[name] += int(suite.get(name, "0"))
    return totals


@pytest.fixture(scope="module")
def java_build() -> subprocess.CompletedProcess[str]:
    """`mvn verify` in sdk/java, once for this module."""
    return maven("verify")


@pytest.fixture(scope="module")
def test_classpath(java_build: subprocess.CompletedProcess[str],
                   tmp_path_factory: pytest.TempPathFactory) -> str:
    """Classpath of the SDK's classes, test classes and dependencies."""
    if java_build.returncode != 0:
        pytest.skip("the Maven build failed (see test_java_sdk_builds_and_its_tests_pass)")
    out = tmp_path_factory.mktemp("java") / "classpath.txt"
    done = maven("dependency:build-classpath", f"-Dmdep.outputFile={out}",
                 "-Dmdep.includeScope=test")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    target = JAVA_DIR / "target"
    return os.pathsep.join([str(target / "test-classes"), str(target / "classes"),
                            out.read_text().strip()])


def test_java_sdk_builds_and_its_tests_pass(java_build: subprocess.CompletedProcess[str]) -> None:
    assert java_build.returncode == 0, (f"mvn verify failed in {JAVA_DIR}:\n"
                                        f"{java_build.stdout[-8000:]}\n{java_build.stderr[-4000:]}")
    counts = surefire_counts()
    assert counts["failures"] == counts["errors"] == 0, counts
    # Every conformance vector is one test; the round trips come on top.
    manifest = json.loads((PROJECT_ROOT / "conformance" / "manifest.json").read_text())
    assert counts["tests"] > len(manifest["envelopes"]) + len(manifest["entries"]), counts
    assert (JAVA_DIR / "target").glob("kombu-envelope-*.jar")


def test_python_publishes_java_worker_runs(test_classpath: str, redis_url: str,
                                           redis_client: redis.Redis, key_prefix: str) -> None:
    queue = f"orders-{uuid.uuid4().hex[:6]}"
    publisher = Publisher(redis_client, Settings(key_prefix=key_prefix))
    now_env = Envelope.new(task_type="interop.echo", payload={"order_id": "202509110001", "n": 7})
    due = datetime.now(timezone(timedelta(hours=8))) + timedelta(seconds=1)
    later_env = Envelope.new(task_type="interop.echo", payload={"later": True}, schedule_time=due)
    first = Envelope.new(task_type="interop.echo", payload={"k": 1}, idempotency_key="order-9")
    duplicate = Envelope.new(task_type="interop.echo", payload={"k": 2}, idempotency_key="order-9")
    for env in (now_env, later_env, first):
        publisher.publish(queue, env)

    done = run_java(test_classpath, "InteropWorker", [redis_url, key_prefix, queue, "3", "60"], 90)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    expected = sorted(e.task_id for e in (now_env, later_env, first))
    assert sorted(r["task_id"] for r in runs) == expected
    by_id = {r["task_id"]: r for r in runs}
    assert by_id[now_env.task_id]["payload"] == {"order_id": "202509110001", "n": 7}
    assert by_id[now_env.task_id]["trace_id"] == now_env.trace_id

    # The done marker the Java worker wrote stops a Python-published duplicate.
    publisher.publish(queue, duplicate)
    again = run_java(test_classpath, "InteropWorker", [redis_url, key_prefix, queue, "1", "3"])
    assert again.returncode == 2, again.stdout[-4000:] + again.stderr[-4000:]  # nothing ran
    assert not [line for line in again.stdout.splitlines() if line.startswith("{")]

    keys = KeySpace(key_prefix).queue(queue)
    assert all(redis_client.xlen(stream) == 0 for stream in keys.task_streams)
    assert redis_client.zcard(keys.delayed) == 0
    assert redis_client.xlen(keys.dead) == 0
    assert not redis_client.keys(f"{key_prefix}:consumer:*")
    marker = redis_client.get(f"{key_prefix}:idem:interop.echo:order-9")
    assert marker is not None and marker.startswith(f"done {first.task_id} ".encode())


def test_the_java_project_ships_the_lua_copies() -> None:
    copies = JAVA_DIR / "src" / "main" / "resources" / "io" / "kombuenvelope" / "lua"
    sources = sorted(p.name for p in (PROJECT_ROOT / "kombu_envelope" / "lua").glob("*.lua"))
    assert sorted(p.name for p in copies.glob("*.lua")) == sources
    assert Path(JAVA_DIR / "pom.xml").is_file()


def run_java(classpath: str, main: str, args: Sequence[str],
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert JAVA is not None
    return subprocess.run([JAVA, "-cp", classpath, f"io.kombuenvelope.{main}", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_java_publishes_python_reads(test_classpath: str, redis_url: str,
                                     redis_client: redis.Redis, key_prefix: str) -> None:
    queue = f"orders-{uuid.uuid4().hex[:6]}"
    done = run_java(test_classpath, "InteropProducer", [redis_url, key_prefix, queue])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    keys = KeySpace(key_prefix).queue(queue)

    [(_, high)] = redis_client.xrange(keys.task_streams[0])
    env = decode_entry(high)
    assert env.task_id == ids["now"] and env.trace_id == ids["trace_id"]
    assert env.payload == {"order_id": "202509110001", "store_id": 7}
    assert (env.priority, env.timeout_ms, env.max_retries) == (200, 30_000, 0)
    assert env.idempotency_key == "202509110001"
    assert env.headers == {"x-retry-policy": "tiered"}
    assert env.ext == {"celery": {"root_id": "r-1", "group": None}}

    [(_, low)] = redis_client.xrange(keys.task_streams[2])
    assert low[b"enc"] == b"json+gzip"
    assert decode_entry(low).task_id == ids["big"]

    later = DelayedTasks(redis_client, Settings(key_prefix=key_prefix)).get(ids["later"], queue)
    assert later is not None and later.envelope is not None
    assert later.envelope.max_retries is None
    assert later.envelope.schedule_time is not None
    assert later.envelope.schedule_time.utcoffset() == timedelta(hours=8)
    assert redis_client.sismember(f"{key_prefix}:queues", queue)


def test_java_dead_letters_read_by_python(test_classpath: str, redis_url: str,
                                          redis_client: redis.Redis, key_prefix: str) -> None:
    queue = f"orders-{uuid.uuid4().hex[:6]}"
    unknown = Envelope.new(task_type="nobody.runs.this", payload={"n": 1})
    Publisher(redis_client, Settings(key_prefix=key_prefix)).publish(queue, unknown)
    redis_client.xadd(KeySpace(key_prefix).queue(queue).task_streams[1],
                      {"v": "1", "enc": "json", "body": b"\xff not json"})
    echo = Envelope.new(task_type="interop.echo", payload={})
    Publisher(redis_client, Settings(key_prefix=key_prefix)).publish(queue, echo)

    done = run_java(test_classpath, "InteropWorker", [redis_url, key_prefix, queue, "1", "60"], 90)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    dead = DeadLetters(redis_client, Settings(key_prefix=key_prefix))
    entries = dead.list([queue])
    assert sorted(e.failure_class for e in entries) == ["malformed_entry", "unknown_task_type"]
    for entry in entries:
        fields = redis_client.xrange(KeySpace(key_prefix).queue(queue).dead,
                                     entry.entry_id, entry.entry_id)[0][1]
        parsed = parse_dead_letter_fields(fields)
        assert parsed.language == "java"
    [malformed] = [e for e in entries if e.failure_class == "malformed_entry"]
    assert malformed.raw["body"] == b"\xff not json"
    [unknown_dead] = [e for e in entries if e.failure_class == "unknown_task_type"]
    assert unknown_dead.envelope is not None and unknown_dead.envelope.task_id == unknown.task_id
