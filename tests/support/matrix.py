"""The processes of the cross-language matrix (``tests/test_matrix.py``) and its records.

Every language runs one long-lived process for the module, which produces and works:

* Python: a real ``celery worker`` of ``tests/apps/matrix_app.py`` (the worker side) and
  :class:`CeleryPeer`, the same Celery app in this process (the producer side);
* Go, Node.js, Java: :class:`JsonLinePeer`, a subprocess of the language's peer
  (``tests/interop/go`` ``matrix``, ``tests/interop/node/matrix.js``,
  ``tests/interop/java`` ``MatrixPeer``) that works the queues it is given and answers
  JSON-line commands on stdin: ``publish``, ``replay``, ``cancel`` and ``consume``.

Both kinds of peer have the same methods: :meth:`~Peer.send` a command and
:meth:`~Peer.receive` its answer, so a scenario sends to every peer before waiting for
any. The handler ``matrix.task`` of every language records in Redis what it did, under
``<prefix>:mx:`` (see :class:`Records`).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Protocol

import redis
from celery import Celery

from bench.drill.peers import PeerBuildError, build_java
from kombu_envelope.keys import KeySpace
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters, ReplayEdit
from support import wait_for
from support.envelope_streams import envelope_url, pending_count
from support.peers import GO_DIR, NODE, NODE_DIR
from support.workers import PROJECT_ROOT, CeleryWorker

__all__ = [
    "JAVA_DIR",
    "LANGUAGES",
    "CeleryPeer",
    "JsonLinePeer",
    "Launcher",
    "Peer",
    "PeerError",
    "Records",
    "build_java_peer",
    "queue_drained",
]

#: Every language of the matrix, as the handlers name themselves in their records.
LANGUAGES = ("py", "go", "node", "java")
#: The Java peer: a Maven reactor of the SDK (sdk/java) and the peer module that depends on it.
JAVA_DIR = PROJECT_ROOT / "tests" / "interop" / "java"
#: The Celery app every Python worker of the matrix runs.
CELERY_APP = "apps.matrix_app"
GROUP = "workers"
ANSWER_TIMEOUT_S = 30.0
#: The lease of every matrix worker: a killed worker's task is taken over this soon.
LEASE_MS = 3000


class PeerError(AssertionError):
    """A peer answered a command with an error, or not at all."""


class Peer(Protocol):
    """What a scenario asks of a language: send commands, then collect their answers."""

    language: str

    def send(self, op: str, **fields: Any) -> None:
        """Send one command (answered in order by :meth:`receive`)."""

    def receive(self) -> dict[str, Any]:
        """The answer to the oldest command not yet received; raises PeerError on failure."""


class JsonLinePeer:
    """A peer subprocess speaking JSON lines on stdin/stdout; its stderr goes to a file."""

    def __init__(self, language: str, argv: Sequence[str], log_path: Path,
                 cwd: Path | None = None) -> None:
        self.language = language
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log)
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next_id = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def _line(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise PeerError(f"{self.language} peer did not answer within {timeout} s:\n"
                            f"{self.log_tail()}") from None
        if not line:
            raise PeerError(f"{self.language} peer exited ({self.proc.poll()}):\n{self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait for the ``{"ready": true}`` line the peer prints once it works its queues."""
        ready = self._line(timeout)
        if not ready.get("ready"):
            raise PeerError(f"{self.language} peer did not start: {ready}\n{self.log_tail()}")

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self._next_id += 1
        line = json.dumps({"id": self._next_id, "op": op, **fields}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        answer = self._line(ANSWER_TIMEOUT_S)
        if not answer.get("ok"):
            raise PeerError(f"{self.language} peer failed: {answer.get('error')}")
        return answer

    def log_tail(self, limit: int = 6000) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-limit:]

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self, timeout: float = 10.0) -> None:
        """Close stdin (the peer stops its workers and exits), or kill it after ``timeout``."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class CeleryPeer:
    """The Python producer side: a Celery app on ``envelope://`` in this process.

    ``publish`` is Celery's ``send_task`` (``eta`` for ``schedule_time``, ``expires``, the
    task's ``headers`` and the headers ``max_retries``, ``idempotency_key`` and
    ``x-retry-policy``); ``cancel`` is
    Celery's ``revoke()``, which answers no outcome (``None``); ``replay`` is
    :class:`kombu_envelope.store.dead_letters.DeadLetters`. Answers are computed when sent.
    """

    language = "py"

    def __init__(self, app: Celery, client: redis.Redis, prefix: str) -> None:
        self.app = app
        self.dead = DeadLetters(client, Settings(key_prefix=prefix))
        self._answers: list[dict[str, Any]] = []

    def send(self, op: str, **fields: Any) -> None:
        answer: dict[str, Any]
        if op == "publish":
            queue_name = fields["queue"]
            answer = {"task_ids": [self._send_task(queue_name, task) for task in fields["tasks"]]}
        elif op == "cancel":
            for task_id in fields["task_ids"]:
                self.app.control.revoke(task_id)
            answer = {"outcomes": [{"outcome": None, "queue": None}] * len(fields["task_ids"])}
        elif op == "replay":
            edit = ReplayEdit(payload=fields.get("payload"))
            answer = {"entry_id": self.dead.replay(fields["queue"], fields["entry_id"], edit,
                                                   operator="matrix")}
        else:
            raise PeerError(f"the Python peer has no op {op!r}")
        self._answers.append(answer)

    def receive(self) -> dict[str, Any]:
        return self._answers.pop(0)

    def _send_task(self, queue_name: str, task: Mapping[str, Any]) -> str:
        headers: dict[str, Any] = dict(task.get("headers") or {})
        if "max_retries" in task:
            headers["max_retries"] = task["max_retries"]
        for field in ("idempotency_key", "ordering_key"):
            if task.get(field):
                headers[field] = task[field]
        if task.get("retry_policy"):
            headers["x-retry-policy"] = task["retry_policy"]
        eta, expires = task.get("schedule_time"), task.get("expires")
        sent = self.app.send_task(
            task["task_type"], kwargs=dict(task.get("payload") or {}), queue=queue_name,
            task_id=task.get("task_id"), eta=datetime.fromisoformat(eta) if eta else None,
            expires=datetime.fromisoformat(expires) if expires else None, headers=headers,
        )
        return str(sent.id)


class Records:
    """What the ``matrix.task`` handlers recorded, per task id, in ``<prefix>:mx:*`` lists.

    ``effect`` holds ``<language>:<unix ms>`` per effect, ``attempts``
    ``<language>:<retry_count>`` per attempt, ``started`` ``<language>`` per attempt
    that held (``hold_ms``) and ``trace`` the JSON ``{"language", "traceparent",
    "tracestate", "trace_id"}`` of the headers each attempt came with.
    """

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def read(self, what: str, task_ids: Iterable[str]) -> dict[str, list[str]]:
        ids = list(task_ids)
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.lrange(f"{self.prefix}:mx:{what}:{task_id}", 0, -1)
        return {task_id: [item.decode() for item in items]
                for task_id, items in zip(ids, pipe.execute(), strict=True)}

    def traces(self, task_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """task_id -> the trace headers of each attempt, in order."""
        return {task_id: [json.loads(item) for item in items]
                for task_id, items in self.read("trace", task_ids).items()}

    def effects(self, task_ids: Iterable[str]) -> dict[str, list[str]]:
        """task_id -> the language of each effect, in order."""
        return {task_id: [item.split(":", 1)[0] for item in items]
                for task_id, items in self.read("effect", task_ids).items()}

    def effect_times(self, task_ids: Iterable[str]) -> dict[str, list[int]]:
        """task_id -> the time (unix ms) of each effect."""
        return {task_id: [int(item.split(":", 1)[1]) for item in items]
                for task_id, items in self.read("effect", task_ids).items()}

    def wait_effects(self, task_ids: Iterable[str], timeout: float,
                     message: Any = "effects missing", settle: float = 0.5) -> dict[str, list[str]]:
        """Wait until every task had an effect, then ``settle`` seconds for duplicates."""
        ids = list(task_ids)

        def missing() -> list[str]:
            effects = self.effects(ids)
            return [task_id for task_id in ids if not effects[task_id]]

        wait_for(lambda: not missing(), timeout=timeout, interval=0.1,
                 message=lambda: f"no effect yet for {missing()}\n"
                                 f"{message() if callable(message) else message}")
        time.sleep(settle)
        return self.effects(ids)


@dataclass(frozen=True)
class Launcher:
    """Starts the matrix's processes on one Redis and key prefix (started, not waited for:
    call ``wait_ready()``). Results Celery callers ask for go to the same Redis."""

    redis_url: str
    prefix: str
    tmp: Path
    go_binary: Path
    java_classpath: str

    def peer(self, language: str, *work: str, concurrency: int = 1) -> JsonLinePeer:
        """A Go, Node or Java peer process working the queues ``work``, running up to
        ``concurrency`` tasks at once."""
        common = ["--redis", self.redis_url, "--prefix", self.prefix, "--work", ",".join(work),
                  "--results", self.redis_url, "--concurrency", str(concurrency)]
        log = self.tmp / f"{language}-{uuid.uuid4().hex[:6]}.log"
        if language == "go":
            return JsonLinePeer("go", [str(self.go_binary), "matrix", *common], log, cwd=GO_DIR)
        if language == "node":
            assert NODE is not None
            return JsonLinePeer("node", [NODE, "matrix.js", *common], log, cwd=NODE_DIR)
        assert language == "java", language
        return JsonLinePeer("java", ["java", "-cp", self.java_classpath,
                                     "io.kombuenvelope.matrix.MatrixPeer", *common], log)

    def celery(self, *queues: str, concurrency: int = 1) -> CeleryWorker:
        """A ``celery worker`` of the matrix app on ``queues`` (prefork with ``concurrency``
        processes when more than one, else solo)."""
        worker = CeleryWorker(
            CELERY_APP, queues=queues, log_path=self.tmp / f"celery-{uuid.uuid4().hex[:6]}.log",
            pool="prefork" if concurrency > 1 else "solo", concurrency=concurrency,
            env={"TEST_BROKER_URL": envelope_url(self.redis_url),
                 "TEST_RESULT_BACKEND": self.redis_url, "TEST_KEY_PREFIX": self.prefix,
                 "TEST_LEASE_MS": str(LEASE_MS)},
        )
        return worker.start(wait_ready=False)


def queue_drained(client: redis.Redis, prefix: str, queue_name: str) -> bool:
    """Every task stream of the queue empty with nothing pending, and nothing delayed."""
    keys = KeySpace(prefix).queue(queue_name)
    return (not any(client.xlen(stream) or pending_count(client, stream, GROUP)
                    for stream in keys.task_streams)
            and not client.zcard(keys.delayed) and not client.hlen(keys.delayed_data))


def build_java_peer() -> str:
    """Build the SDK and the Java peer with Maven, offline, without the SDK's tests (which
    ``tests/test_sdk_java.py`` runs); return the peer's classpath."""
    try:
        return build_java()
    except PeerBuildError as exc:
        raise PeerError(str(exc)) from exc
