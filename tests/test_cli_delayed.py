"""``celery -A <app> envelope delayed|cancel|scheduler`` run as real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from apps.envelope_app import create_app
from celery import Celery
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR

from kombu_envelope.keys import KeySpace, QueueKeys

APP = "apps.envelope_app"


@pytest.fixture
def env(redis_url: str, key_prefix: str) -> dict[str, str]:
    paths = [str(TESTS_DIR), str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "TEST_BROKER_URL": envelope_url(redis_url),
            "TEST_RESULT_BACKEND": redis_url, "TEST_KEY_PREFIX": key_prefix,
            "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix)
    yield app
    app.close()


@pytest.fixture
def keys(key_prefix: str) -> QueueKeys:
    return KeySpace(key_prefix).queue("celery")


def envelope_command(env: dict[str, str], *args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", APP, "envelope", *args]


def run(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(envelope_command(env, *args), cwd=PROJECT_ROOT, env=env, text=True,
                          capture_output=True, timeout=60)
    if ok:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def run_json(env: dict[str, str], *args: str) -> Any:
    return json.loads(run(env, *args, "--json").stdout)


def test_delayed_count_list_and_show(app: Celery, env: dict[str, str]) -> None:
    add, flaky = app.tasks["envelope_app.add"], app.tasks["envelope_app.flaky"]
    later = add.apply_async((1, 1), countdown=7200)
    soonest = flaky.apply_async(("k", 0), countdown=3600)
    add.apply_async((2, 2), countdown=10800)
    add.apply_async((3, 3), countdown=3600, queue="other")

    assert run_json(env, "delayed", "count") == {"celery": 3, "other": 1}
    table = run(env, "delayed", "count").stdout.splitlines()
    assert table[0].split() == ["queue", "delayed"]
    assert [line.split() for line in table[2:]] == [["celery", "3"], ["other", "1"]]
    assert run_json(env, "delayed", "count", "-Q", "celery") == {
        "envelope_app.add": 2, "envelope_app.flaky": 1}

    listed = run_json(env, "delayed", "list", "-Q", "celery", "--limit", "2")
    assert [item["task_id"] for item in listed] == [soonest.id, later.id]
    assert listed[0]["envelope"]["task_type"] == "envelope_app.flaky"
    assert listed[0]["due"] < listed[1]["due"]
    only_add = run(env, "delayed", "list", "-Q", "celery", "--task-type",
                   "envelope_app.add").stdout
    assert later.id in only_add and soonest.id not in only_add

    shown = json.loads(run(env, "delayed", "show", later.id).stdout)
    assert shown["queue"] == "celery"
    assert shown["envelope"]["task_id"] == later.id
    assert shown["envelope"]["payload"] == {"x": 1, "y": 1}
    missing = run(env, "delayed", "show", "no-such-task", ok=False)
    assert missing.returncode == 1
    assert "no delayed task no-such-task" in missing.stderr


def test_cancel_command_says_what_it_did(
    app: Celery, env: dict[str, str], redis_client: redis.Redis, keys: QueueKeys,
) -> None:
    task = app.tasks["envelope_app.add"].apply_async((1, 2), countdown=3600)
    elsewhere = app.tasks["envelope_app.add"].apply_async((1, 2), countdown=3600,
                                                          queue="elsewhere")
    outputs = [run(env, "cancel", task.id, "-Q", "celery").stdout for _ in range(2)]
    assert [text.split(":")[0] for text in outputs] == ["removed", "already"]
    assert "was delayed in queue celery; it will never run" in outputs[0]
    assert redis_client.zcard(keys.delayed) == 0
    # Without a queue, every queue's delayed set is looked at.
    found = run(env, "cancel", elsewhere.id).stdout
    assert found.startswith(f"removed: task {elsewhere.id} was delayed in queue elsewhere")
    unknown = [run(env, "cancel", "no-such-task").stdout for _ in range(2)]
    assert unknown[0].startswith("marked: task no-such-task is not delayed")
    assert "acknowledges it without running it" in unknown[0]
    assert unknown[1].startswith("already: task no-such-task was already marked cancelled")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_scheduler_command_promotes_until_stopped(
    app: Celery, env: dict[str, str], redis_client: redis.Redis, keys: QueueKeys,
    signum: signal.Signals,
) -> None:
    fd, name = tempfile.mkstemp(prefix="envelope-scheduler-", suffix=".log")
    log_path = Path(name)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(envelope_command(env, "scheduler"), cwd=PROJECT_ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        def output() -> str:
            return log_path.read_text(errors="replace")

        wait_for(lambda: "promoting delayed tasks" in output(), timeout=30, message=output)
        task = app.tasks["envelope_app.add"].apply_async((1, 2), countdown=0.3)
        wait_for(lambda: sum(redis_client.xlen(s) for s in keys.task_streams) == 1,
                 timeout=10, message=output)
        assert redis_client.zscore(keys.delayed, task.id) is None
        proc.send_signal(signum)
        assert proc.wait(timeout=15) == 0, output()
        assert "scheduler stopped" in output()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_path.unlink(missing_ok=True)

