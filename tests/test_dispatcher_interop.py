"""Go, Node.js and Java programs schedule, inspect and cancel a task through the dispatcher
with their standard HTTP clients (tests/interop/dispatcher/)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from support.announce import announce

from kombu_envelope import Settings
from kombu_envelope.testing.dispatcher import DispatcherProcess

TOKEN = "w-" + "e" * 30
PREFIX = f"t-di-{uuid.uuid4().hex[:8]}"
CLIENTS = Path(__file__).resolve().parent / "interop" / "dispatcher"


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, [{"name": "ops", "scope": "operator", "token": TOKEN}],
                           {"key_prefix": PREFIX}) as proc:
        yield proc


def _command(language: str, tmp_path: Path) -> list[str]:
    tool = {"go": "go", "node": "node", "java": "java"}[language]
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not on PATH")
    if language == "go":
        binary = tmp_path / "dispatcherclient"
        built = subprocess.run(["go", "build", "-o", str(binary), "."], cwd=CLIENTS / "go",
                               capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        return [str(binary)]
    if language == "node":
        return ["node", str(CLIENTS / "node" / "client.mjs")]
    return ["java", str(CLIENTS / "java" / "DispatcherClient.java")]


@pytest.mark.parametrize("language", ["go", "node", "java"])
def test_client_schedules_inspects_and_cancels(language: str, server: DispatcherProcess,
                                               redis_url: str, tmp_path: Path) -> None:
    queue = f"q-{language}-{uuid.uuid4().hex[:8]}"
    announce(redis_url, PREFIX, queue, {"bill.charge": [1]})
    ran = subprocess.run([*_command(language, tmp_path), server.url, TOKEN, queue],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr + ran.stdout
    task_id = ran.stdout.strip()
    state = httpx.get(f"{server.url}/tasks/{task_id}",
                      headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert state["state"] == "cancelled" and state["reason"] == "cancelled"
    client = redis.Redis.from_url(redis_url)
    keys = Settings(key_prefix=PREFIX).keys
    assert client.zscore(keys.cancelled, task_id) is not None
    assert client.zcard(keys.queue(queue).delayed) == 0
    client.close()
