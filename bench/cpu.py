"""CPU time per task: of a process tree (``/proc/<pid>/stat`` through psutil), of Redis
(``INFO CPU``) and of RabbitMQ (its ``beam.smp`` process), read together."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import psutil

from bench.core import AMQP, RedisClient

#: One figure: CPU seconds used so far by one process (tree) or server.
CpuSource = Callable[[], float]


def process_tree_s(pid: int) -> CpuSource:
    """User + system CPU of ``pid``, its live descendants and the children it has reaped."""
    def read() -> float:
        try:
            main = psutil.Process(pid)
            total = _times_s(main.cpu_times(), with_reaped=True)
            for child in main.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += _times_s(child.cpu_times(), with_reaped=False)
            return total
        except psutil.NoSuchProcess:
            return math.nan
    return read


def _times_s(times: Any, with_reaped: bool) -> float:
    total = times.user + times.system
    if with_reaped:
        total += times.children_user + times.children_system
    return float(total)


def this_process_s() -> float:
    """User + system CPU of the benchmark process itself (the publisher)."""
    return time.process_time()


def redis_s(client: RedisClient) -> CpuSource:
    """``used_cpu_user + used_cpu_sys`` of the Redis ``client`` talks to."""
    def read() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return read


def rabbitmq_pid() -> int | None:
    """Pid of the local RabbitMQ node (``beam.smp``), or None when none is found."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["name"] == "beam.smp" and "rabbit" in " ".join(
                    proc.info["cmdline"] or ()):
                return int(proc.pid)
    return None


def broker_cpu(transport: str, client: RedisClient) -> CpuSource:
    """CPU of ``transport``'s broker: the private Redis, or the local RabbitMQ node
    (NaN when no ``beam.smp`` process is found on this machine)."""
    if transport != AMQP:
        return redis_s(client)
    pid = rabbitmq_pid()
    return process_tree_s(pid) if pid is not None else (lambda: math.nan)


def cpu_note(transports: list[str]) -> str:
    """How the CPU figures are taken."""
    rabbit = ""
    if AMQP in transports:
        rabbit = (" RabbitMQ's is its `beam.smp` process (with children)"
                  + ("" if rabbitmq_pid() is not None else ", not found on this machine: n/a")
                  + "; the tasks' own Redis commands are then not counted as broker CPU.")
    return ("CPU per task: user + system time of the publishing process around its "
            "publish loop (`time.process_time()`), of the worker's process tree (pool "
            "processes included, `/proc/<pid>/stat` through psutil) over the measured "
            "window, and of the broker: Redis "
            "`INFO CPU` (`used_cpu_user` + `used_cpu_sys`), which includes the one command "
            "each task writes and the benchmark's polling (the same on every Redis "
            f"transport).{rabbit}")


class CpuClock:
    """Named CPU sources read at the same moment, and the µs per task between two reads."""

    def __init__(self, sources: Mapping[str, CpuSource]) -> None:
        self.sources = dict(sources)

    def read(self) -> dict[str, float]:
        """CPU seconds of every source now."""
        return {name: source() for name, source in self.sources.items()}

    @staticmethod
    def per_task_us(before: Mapping[str, float], after: Mapping[str, float],
                    tasks: int) -> dict[str, float]:
        """µs of CPU per task of every source between ``before`` and ``after``."""
        return {name: (after[name] - before[name]) * 1e6 / tasks if tasks > 0 else math.nan
                for name in before}
