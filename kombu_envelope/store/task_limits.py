"""TaskLimits per task type (docs/protocol.md, section 19): concurrency and rate, per queue.

A task type's limits live in ``<prefix>:{<queue>}:limits``, field ``<task_type>``, as
JSON; ``read.lua`` reads them on every call and hands out an entry of a limited type
only when the type may start one more attempt, so the limits hold across every worker
of every language, and a change takes effect without a restart::

    limits = TaskLimits(client, settings)
    limits.set("emails", "send_email", TaskLimit(concurrency=50, rate=10, burst=5))
    limits.all("emails")        # {"send_email": TaskLimit(concurrency=50, rate=10.0, burst=5)}
    limits.remove("emails", "send_email")

:func:`parse_limit` checks a limit the way every SDK does (the vectors in
``conformance/limits/``), naming the member and the rule it breaks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kombu_envelope.envelope import TASK_TYPE_PATTERN
from kombu_envelope.errors import InvalidTaskLimit
from kombu_envelope.settings import Settings
from kombu_envelope.store.replies import as_text

__all__ = ["TaskLimit", "TaskLimits", "parse_limit"]

_MEMBERS = ("concurrency", "rate", "burst", "smooth")


@dataclass(frozen=True)
class TaskLimit:
    """The limits of one task type on one queue."""

    #: Attempts running at once, all workers together.
    concurrency: int | None = None
    #: Starts per second.
    rate: float | None = None
    #: Starts allowed back to back above the rate after an idle spell (default 1).
    burst: int | None = None
    #: Space every start evenly (burst 1).
    smooth: bool | None = None

    def __post_init__(self) -> None:
        parse_limit(self.as_json())

    def as_json(self) -> dict[str, Any]:
        """The members that are set, as stored."""
        return {name: value for name in _MEMBERS
                if (value := getattr(self, name)) is not None}

    def describe(self) -> str:
        """One line for people, e.g. ``concurrency 50, rate 10/s, burst 5``."""
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if self.rate is not None:
            parts.append(f"rate {self.rate:g}/s")
        if self.burst is not None:
            parts.append(f"burst {self.burst}")
        if self.smooth:
            parts.append("smooth")
        return ", ".join(parts)


def parse_limit(value: Any) -> TaskLimit:
    """The :class:`TaskLimit` of a JSON value, or :class:`InvalidTaskLimit` naming the member and
    the rule it breaks (``type``, ``minimum``, ``required``, ``unknown_field``)."""
    if not isinstance(value, dict):
        raise InvalidTaskLimit("", "type", "limits must be a JSON object")
    for name in value:
        if name not in _MEMBERS:
            raise InvalidTaskLimit(str(name), "unknown_field",
                               f"unknown member; known: {', '.join(_MEMBERS)}")
    checks = {"concurrency": (_is_int, 1, "an integer ≥ 1"),
              "rate": (_is_number, 0, "a number > 0"),
              "burst": (_is_int, 1, "an integer ≥ 1")}
    for name, (is_type, least, wanted) in checks.items():
        if name not in value:
            continue
        member = value[name]
        if not is_type(member):
            raise InvalidTaskLimit(name, "type", f"must be {wanted}, not {member!r}")
        if member < least or (name == "rate" and member <= 0):
            raise InvalidTaskLimit(name, "minimum", f"must be {wanted}, not {member!r}")
    if "smooth" in value and not isinstance(value["smooth"], bool):
        raise InvalidTaskLimit("smooth", "type", f"must be true or false, not {value['smooth']!r}")
    if "concurrency" not in value and "rate" not in value:
        raise InvalidTaskLimit("concurrency", "required", "give concurrency, rate or both")
    limit = object.__new__(TaskLimit)
    for name in _MEMBERS:
        member = value.get(name)
        object.__setattr__(limit, name, float(member) if name == "rate" and member is not None
                           else member)
    return limit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TaskLimits:
    """Reads and writes the limits of a queue's task types."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings

    def set(self, queue: str, task_type: str, limit: TaskLimit) -> None:
        """Give ``task_type`` on ``queue`` these limits (replacing any it had)."""
        if not re.fullmatch(TASK_TYPE_PATTERN, task_type):
            raise InvalidTaskLimit("task_type", "pattern", f"not a task type: {task_type!r}")
        self.client.hset(self.settings.keys.queue(queue).limits, task_type,
                         json.dumps(limit.as_json(), separators=(",", ":")))

    def get(self, queue: str, task_type: str) -> TaskLimit | None:
        """The limits of ``task_type`` on ``queue``, or None."""
        raw = self.client.hget(self.settings.keys.queue(queue).limits, task_type)
        return None if raw is None else parse_limit(json.loads(raw))

    def all(self, queue: str) -> dict[str, TaskLimit]:
        """Every limited task type of ``queue`` with its limits, by name."""
        stored = self.client.hgetall(self.settings.keys.queue(queue).limits)
        return {as_text(name): parse_limit(json.loads(raw))
                for name, raw in sorted(stored.items())}

    def remove(self, queue: str, task_type: str) -> bool:
        """Lift the limits of ``task_type`` on ``queue``; False if it had none."""
        return bool(self.client.hdel(self.settings.keys.queue(queue).limits, task_type))
