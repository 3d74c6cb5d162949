"""A kombu consumer of Envelope tasks, run as a real process by the crash tests.

Run it as::

    python -m support.kombu_consumer --url envelope://127.0.0.1:PORT/0 --prefix PREFIX \\
        --queue QUEUE --lease-ms 1500 --sleep-s 0.5 --out FILE

It consumes with ``drain_events``. For every task it appends the ``task_id``
to FILE when the task starts and ``done <task_id>`` when it finishes, each
line flushed and fsynced (a SIGKILL loses nothing already written); the task
"works" by sleeping ``--sleep-s`` seconds and is then acknowledged. Progress
(``ready``, ``connection lost``, ``reconnected``, ``stopped``) and the
transport's warnings go to stdout.

Like a Celery worker:

* SIGTERM is a warm shutdown: the running task finishes, tasks prefetched but
  not started stay unacknowledged, and closing the connection gives them back.
* When the connection to Redis is lost, the consumer drops it, connects again
  with ``ensure_connection`` (retrying until Redis answers) and consumes again.

:class:`ConsumerProcess` starts and watches such a process from a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["ConsumerProcess", "main"]

TESTS_DIR = Path(__file__).resolve().parent.parent
PROJECT_ROOT = TESTS_DIR.parent

READY = "ready"
RECONNECTED = "reconnected"
STOPPED = "stopped"


# ----------------------------------------------------------------- the process


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m support.kombu_consumer",
                                     description="Consume Envelope tasks with kombu.")
    parser.add_argument("--url", required=True, help="envelope:// broker URL")
    parser.add_argument("--prefix", required=True, help="transport option key_prefix")
    parser.add_argument("--queue", required=True, help="queue to consume")
    parser.add_argument("--lease-ms", type=int, required=True, help="transport option lease_ms")
    parser.add_argument("--sleep-s", type=float, default=0.0, help="seconds each task works")
    parser.add_argument("--out", required=True, help="file receiving started/done lines")
    parser.add_argument("--prefetch", type=int, default=1, help="prefetch_count (0: no limit)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=JSON",
                        help="another transport option, e.g. max_redeliveries=2")
    return parser.parse_args(argv)


def _say(text: str) -> None:
    print(text, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Consume until SIGTERM; see the module documentation."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                        format="%(levelname)s %(name)s: %(message)s")
    import kombu

    import kombu_envelope  # noqa: F401  (registers the envelope:// transport)

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    options: dict[str, Any] = {"key_prefix": args.prefix, "lease_ms": args.lease_ms}
    for option in args.option:
        name, _, value = option.partition("=")
        options[name] = json.loads(value)
    queue = kombu.Queue(args.queue)
    prefetched: deque[Any] = deque()

    with open(args.out, "a", encoding="utf-8") as out:

        def record(line: str) -> None:
            out.write(line + "\n")
            out.flush()
            os.fsync(out.fileno())

        def run(message: Any) -> None:
            task_id = message.decode()["task_id"]
            record(task_id)
            time.sleep(args.sleep_s)
            record(f"done {task_id}")
            message.ack()

        connected_before = False
        while not stopping.is_set():
            conn = kombu.Connection(args.url, transport_options=options)
            try:
                conn.ensure_connection(max_retries=None, interval_start=0.05,
                                       interval_step=0.1, interval_max=0.3)
                with conn.Consumer([queue], accept=["envelope", "json"],
                                   callbacks=[lambda body, message: prefetched.append(message)]
                                   ) as consumer:
                    consumer.qos(prefetch_count=args.prefetch)
                    _say(RECONNECTED if connected_before else READY)
                    connected_before = True
                    while not stopping.is_set():
                        if prefetched:
                            run(prefetched.popleft())
                            continue
                        try:
                            conn.drain_events(timeout=0.5)
                        except TimeoutError:
                            pass
            except conn.connection_errors as exc:
                _say(f"connection lost: {exc!r}")
                prefetched.clear()  # unacked: their lease gives them back
                time.sleep(0.05)  # like a worker's retry interval, before connecting again
            finally:
                conn.release()  # gives back what was prefetched and not started
    _say(STOPPED)
    return 0


# ---------------------------------------------------------- the test's handle


class ConsumerProcess:
    """A ``python -m support.kombu_consumer`` subprocess, seen from a test.

    stdout and stderr go to a log file; :meth:`started` and :meth:`done` read
    the ``--out`` file. Use as a context manager: the process is started (and
    awaited until it consumes) on entry and killed on exit if still running.
    """

    def __init__(self, url: str, prefix: str, queue: str, *, lease_ms: int,
                 out: str | os.PathLike[str], sleep_s: float = 0.0, prefetch: int = 1,
                 options: Mapping[str, Any] | None = None, ready_timeout: float = 30.0) -> None:
        self.out = Path(out)
        self.out.touch()
        self.ready_timeout = ready_timeout
        self.command = [
            sys.executable, "-m", "support.kombu_consumer", "--url", url, "--prefix", prefix,
            "--queue", queue, "--lease-ms", str(lease_ms), "--sleep-s", str(sleep_s),
            "--out", os.fspath(self.out), "--prefetch", str(prefetch),
        ]
        for name, value in (options or {}).items():
            self.command += ["--option", f"{name}={json.dumps(value)}"]
        fd, log_name = tempfile.mkstemp(prefix="kombu-consumer-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self, wait_ready: bool = True) -> ConsumerProcess:
        """Spawn the process; optionally wait until it logs ``ready``."""
        env = dict(os.environ)
        paths = [os.fspath(TESTS_DIR), os.fspath(PROJECT_ROOT)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(self.command, cwd=PROJECT_ROOT, env=env,
                                      stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_for_log(READY, self.ready_timeout)
        return self

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (warm shutdown) and wait for the exit status."""
        proc = self._require_proc()
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the process dies holding whatever it holds."""
        proc = self._require_proc()
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def close(self) -> None:
        """Kill the process if it still runs; delete the log."""
        if self._proc is not None and self._proc.poll() is None:
            self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()

    def __enter__(self) -> ConsumerProcess:
        if self._proc is None:
            try:
                self.start()
            except BaseException:
                self._dump_log()
                self.close()
                raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self._dump_log()
        self.close()

    # -- observations ----------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._require_proc().pid

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def lines(self) -> list[str]:
        """Lines of the ``--out`` file so far."""
        return self.out.read_text(encoding="utf-8").splitlines()

    def started(self) -> list[str]:
        """task_ids in the order their runs started (a task run twice appears twice)."""
        return [line for line in self.lines() if line and not line.startswith("done ")]

    def done(self) -> list[str]:
        """task_ids in the order their runs finished."""
        return [line[5:] for line in self.lines() if line.startswith("done ")]

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 30.0, count: int = 1) -> None:
        """Wait until ``text`` appears ``count`` times in the log; fail if the process exits."""
        deadline = time.monotonic() + timeout
        while self.log_text().count(text) < count:
            if not self.is_alive():
                raise AssertionError(f"consumer exited before logging {text!r}:\n"
                                     f"{self.log_text()[-4000:]}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"consumer did not log {text!r} within {timeout:.1f}s:\n"
                                     f"{self.log_text()[-4000:]}")
            time.sleep(0.02)

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("the consumer process was never started")
        return self._proc

    def _dump_log(self) -> None:
        sys.stderr.write(f"\n--- log of {' '.join(self.command[2:4])} pid "
                         f"{self._proc.pid if self._proc else '-'} ---\n"
                         f"{self.log_text()[-6000:]}\n")


if __name__ == "__main__":
    raise SystemExit(main())
