"""The report header: machine, interpreter, servers and library versions."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

import redis
from kombu import Connection


def cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo`` (the platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def redis_server_version(url: str) -> str:
    """``redis_version`` reported by the server at ``url``."""
    client = redis.Redis.from_url(url)
    try:
        return str(client.info("server")["redis_version"])
    finally:
        client.close()


def amqp_server_version(url: str) -> str | None:
    """RabbitMQ's version (from its connection properties), or None."""
    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
            props = getattr(conn.connection, "server_properties", {}) or {}
            version = props.get("version")
            return version.decode() if isinstance(version, bytes) else version
    except Exception:
        return None


def load_average() -> str:
    """The 1-minute load average (other work on the machine skews every figure)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def machine_info(redis_url: str, amqp_url: str | None) -> dict[str, Any]:
    """Everything the report header shows."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "platform": platform.platform(),
        "load_start": load_average(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_server": redis_server_version(redis_url),
        "rabbitmq": amqp_server_version(amqp_url) if amqp_url else None,
        "kombu": _version("kombu"),
        "celery": _version("celery"),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "pydantic": _version("pydantic"),
        "kombu_envelope": _version("kombu-envelope"),
    }
