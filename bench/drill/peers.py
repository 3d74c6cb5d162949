"""The Go, Node.js and Java workers of the drill: the interop peers' ``drill`` commands.

Each peer (``tests/interop/go`` ``drill``, ``tests/interop/node/drill.js``,
``tests/interop/java`` ``DrillPeer``) works the drill's queues with the SDK's Worker
and a ``drill.effect`` handler that records in the ledger what :mod:`bench.drill.app`
records for Celery. :func:`build_peers` builds those a drill needs (``go build``, an
offline Maven package) before any worker starts, once per process.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.drill.config import PYTHON

#: Repository root.
ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / "tests" / "interop"
GO_DIR, NODE_DIR, JAVA_DIR = INTEROP / "go", INTEROP / "node", INTEROP / "java"
#: A cold build compiles go-redis, or resolves the Maven reactor, in minutes.
BUILD_TIMEOUT_S = 300


class PeerBuildError(RuntimeError):
    """A peer could not be built or lacks its toolchain."""


def _run(argv: list[str], cwd: Path, what: str) -> None:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerBuildError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise PeerBuildError(f"{what} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}")


@functools.cache
def build_go() -> Path:
    """``go build`` of the Go peer into a directory of this process (once); its binary."""
    go = shutil.which("go")
    if go is None:
        raise PeerBuildError("the Go workers need go on PATH")
    out_dir = Path(tempfile.mkdtemp(prefix="drill-go-"))
    atexit.register(shutil.rmtree, out_dir, True)
    binary = out_dir / "envelope-peer"
    _run([go, "build", "-o", str(binary), "."], GO_DIR, "go build of tests/interop/go")
    return binary


@functools.cache
def build_java() -> str:
    """Maven package (offline, without the SDK's tests) of the SDK and the Java peer, once
    per process; the peer's classpath."""
    if shutil.which("mvn") is None or shutil.which("java") is None:
        raise PeerBuildError("the Java workers need mvn and java on PATH")
    _run(["mvn", "-o", "-q", "-B", "-f", str(JAVA_DIR / "pom.xml"), "-pl", "peer", "-am",
          "-Dmaven.test.skip=true", "package", "dependency:build-classpath",
          "-Dmdep.outputFile=target/classpath.txt"], JAVA_DIR, "Maven build of tests/interop/java")
    classes = JAVA_DIR / "peer" / "target" / "classes"
    classpath = (JAVA_DIR / "peer" / "target" / "classpath.txt").read_text().strip()
    return os.pathsep.join([str(classes), classpath])


def check_node() -> str:
    """The node binary, once the Node peer's packages are installed."""
    node = shutil.which("node")
    if node is None:
        raise PeerBuildError("the Node.js workers need node on PATH")
    if not (NODE_DIR / "node_modules" / "kombu-envelope").exists():
        raise PeerBuildError(f"run `npm ci` in {NODE_DIR} (and in sdk/node) first")
    return node


@dataclass(frozen=True)
class Peers:
    """How to start a worker of each built language."""

    go_binary: Path | None = None
    node: str | None = None
    java_classpath: str | None = None

    def argv(self, language: str, *, url: str, prefix: str, queues: tuple[str, ...],
             hostname: str, lease_ms: int, concurrency: int, wait_replicas: int
             ) -> tuple[list[str], Path]:
        """The command line of a ``language`` worker, and its working directory."""
        options = ["--redis", url, "--prefix", prefix, "--work", ",".join(queues),
                   "--hostname", hostname, "--lease-ms", str(lease_ms),
                   "--concurrency", str(concurrency), "--wait-replicas", str(wait_replicas)]
        if language == "go" and self.go_binary is not None:
            return [str(self.go_binary), "drill", *options], GO_DIR
        if language == "node" and self.node is not None:
            return [self.node, "drill.js", *options], NODE_DIR
        if language == "java" and self.java_classpath is not None:
            return ["java", "-cp", self.java_classpath, "io.kombuenvelope.drill.DrillPeer",
                    *options], JAVA_DIR
        raise PeerBuildError(f"no {language} worker was built")


def build_peers(languages: tuple[str, ...]) -> Peers:
    """Build the peers of ``languages`` (Python needs none)."""
    wanted = set(languages) - {PYTHON}
    return Peers(go_binary=build_go() if "go" in wanted else None,
                 node=check_node() if "node" in wanted else None,
                 java_classpath=build_java() if "java" in wanted else None)
