"""``celery -A ... envelope dlq ...``: the real command line, run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis
from support.envelope_streams import envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import dead_letter_envelope

QUEUE = "celery"


def dlq(redis_url: str, prefix: str, *args: str, input: str | None = None
        ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TEST_BROKER_URL": envelope_url(redis_url),
           "TEST_RESULT_BACKEND": redis_url, "TEST_KEY_PREFIX": prefix,
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.reliable_app", "envelope", "dlq", *args],
        input=input, capture_output=True, text=True, env=env, cwd=PROJECT_ROOT, timeout=60)


def seed(client: redis.Redis, prefix: str) -> list[str]:
    """Two task_error entries of reliable.versioned and one malformed entry; their ids."""
    settings = Settings(key_prefix=prefix)
    ids = []
    for amount in ("x", "y"):
        envelope = Envelope.new(task_type="reliable.versioned", payload={"amount": amount},
                                retry_count=3)
        ids.append(dead_letter_envelope(
            client, settings, queue=QUEUE, envelope=envelope, consumer="seed",
            failure=Failure(FailureClass.TASK_ERROR, f"amount {amount} is wrong",
                            task_id=envelope.task_id, task_type=envelope.task_type)))
    ids.append(client.xadd(settings.keys.queue(QUEUE).dead, {
        "dlq": "1", "failure_class": "malformed_entry", "reason": "not JSON",
        "raw.v": "1", "raw.enc": "json", "raw.body": b"\xff{"}).decode())
    return ids


@pytest.fixture
def seeded(redis_client: redis.Redis, key_prefix: str) -> list[str]:
    return seed(redis_client, key_prefix)


def test_list_stats_and_show(redis_url: str, key_prefix: str, seeded: list[str]) -> None:
    listed = dlq(redis_url, key_prefix, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    assert [e["id"] for e in entries] == seeded
    assert [e["failure_class"] for e in entries] == ["task_error", "task_error",
                                                     "malformed_entry"]
    assert entries[2]["raw"]["body"].startswith("base64:") and entries[2]["envelope"] is None

    only = json.loads(dlq(redis_url, key_prefix, "list", "--json", "--failure-class",
                          "task_error").stdout)
    assert [e["envelope"]["payload"]["amount"] for e in only] == ["x", "y"]

    stats = dlq(redis_url, key_prefix, "stats")
    assert stats.returncode == 0, stats.stderr
    rows = [line.split() for line in stats.stdout.splitlines()[2:]]
    assert sorted(rows) == [["celery", "?", "malformed_entry", "1"],
                            ["celery", "reliable.versioned", "task_error", "2"]]

    shown = dlq(redis_url, key_prefix, "show", QUEUE, seeded[0])
    assert shown.returncode == 0, shown.stderr
    entry = json.loads(shown.stdout)
    assert (entry["reason"], entry["envelope"]["retry_count"]) == ("amount x is wrong", 3)
    missing = dlq(redis_url, key_prefix, "show", QUEUE, "1-1")
    assert missing.returncode != 0 and "no dead-letter entry" in missing.stderr


def test_replay_with_an_edit(redis_url: str, key_prefix: str, seeded: list[str],
                             redis_client: redis.Redis) -> None:
    replayed = dlq(redis_url, key_prefix, "replay", QUEUE, seeded[0],
                   "--merge-patch", '{"amount": 4}', "--bump-version")
    assert replayed.returncode == 0, replayed.stderr
    assert f"{seeded[0]}: replayed as " in replayed.stdout
    stream = Settings(key_prefix=key_prefix).keys.queue(QUEUE).stream(Bucket.NORMAL)
    [(_, fields)] = redis_client.xrange(stream)
    envelope = decode_entry(fields)
    assert (envelope.payload, envelope.payload_version, envelope.retry_count) == (
        {"amount": 4}, 2, 0)
    again = dlq(redis_url, key_prefix, "replay", QUEUE, seeded[0])
    assert "not found (already replayed or purged)" in again.stdout
    refused = dlq(redis_url, key_prefix, "replay", QUEUE, seeded[2])
    assert refused.returncode != 0 and "holds no valid Envelope" in refused.stderr


def test_purge_asks_for_confirmation(redis_url: str, key_prefix: str, seeded: list[str],
                                     redis_client: redis.Redis) -> None:
    dead = Settings(key_prefix=key_prefix).keys.queue(QUEUE).dead
    declined = dlq(redis_url, key_prefix, "purge", "-Q", QUEUE, input="n\n")
    assert declined.returncode != 0
    assert "Delete 3 dead-letter entries from celery?" in declined.stdout
    assert redis_client.xlen(dead) == 3
    accepted = dlq(redis_url, key_prefix, "purge", "-Q", QUEUE, "--failure-class",
                   "task_error", input="y\n")
    assert accepted.returncode == 0, accepted.stderr
    assert "purged 2" in accepted.stdout
    assert redis_client.xlen(dead) == 1
    forced = dlq(redis_url, key_prefix, "purge", "--yes")
    assert forced.returncode == 0 and "purged 1" in forced.stdout
    assert redis_client.xlen(dead) == 0
    assert "nothing to purge" in dlq(redis_url, key_prefix, "purge", "--yes").stdout
