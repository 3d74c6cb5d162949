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

__all__ = ["Breaker", "TaskLimit", "TaskLimits", "parse_limit"]

@dataclass(frozen=True)
class Breaker:
    """A circuit breaker: no starts for ``cooldown_s`` once ``failure_ratio`` of at least
    ``min_attempts`` attempts within ``window_s`` failed, then ``probes`` let through."""

    failure_ratio: float
    min_attempts: int | None = None  # default 20
    window_s: float | None = None  # default 60
    cooldown_s: float | None = None  # default 30
    probes: int | None = None  # default 1

    def as_json(self) -> dict[str, Any]:
        """The members that are set, as stored."""
        return _set_members(self, _BREAKER_MEMBERS)

    def describe(self) -> str:
        """e.g. ``breaker at 10 % of 20 in 60 s, cool-down 30 s, 1 probe``."""
        probes = self.probes or 1
        return (f"breaker at {self.failure_ratio:.0%} of {self.min_attempts or 20} in "
                f"{self.window_s or 60:g} s, cool-down {self.cooldown_s or 30:g} s, "
                f"{probes} probe{'s' if probes > 1 else ''}")


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
    #: The circuit breaker.
    breaker: Breaker | None = None

    def __post_init__(self) -> None:
        parse_limit(self.as_json())

    def as_json(self) -> dict[str, Any]:
        """The members that are set, as stored."""
        found = _set_members(self, _MEMBERS)
        if self.breaker is not None:
            found["breaker"] = self.breaker.as_json()
        return found

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
        if self.breaker is not None:
            parts.append(self.breaker.describe())
        return ", ".join(parts)


#: Member -> (type, least value, whether the least is excluded, greatest value).
_Rule = tuple[str, float | None, bool, float | None]
_MEMBERS: dict[str, _Rule] = {
    "concurrency": ("integer", 1, False, None), "rate": ("number", 0, True, None),
    "burst": ("integer", 1, False, None), "smooth": ("boolean", None, False, None)}
_BREAKER_MEMBERS: dict[str, _Rule] = {
    "failure_ratio": ("number", 0, True, 1), "min_attempts": ("integer", 1, False, None),
    "window_s": ("number", 0, True, None), "cooldown_s": ("number", 0, True, None),
    "probes": ("integer", 1, False, None)}
_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool)}


def _set_members(value: Any, members: dict[str, _Rule]) -> dict[str, Any]:
    return {name: member for name in members if (member := getattr(value, name)) is not None}


def _checked(value: Any, members: dict[str, _Rule], path: str) -> dict[str, Any]:
    """``value``'s members, checked in the vectors' order: an object, no unknown member,
    then each member's type and bounds; InvalidTaskLimit names the first that breaks."""
    if not isinstance(value, dict):
        raise InvalidTaskLimit(path.rstrip("."), "type", "must be a JSON object")
    for name in value:
        if name not in members and not (name == "breaker" and members is _MEMBERS):
            raise InvalidTaskLimit(f"{path}{name}", "unknown_field",
                                   f"unknown member; known: {', '.join(members)}"
                                   + (", breaker" if members is _MEMBERS else ""))
    for name, (kind, least, exclusive, most) in members.items():
        if name not in value:
            continue
        member, field = value[name], f"{path}{name}"
        if not _TYPES[kind](member):
            raise InvalidTaskLimit(field, "type", f"must be {kind}, not {member!r}")
        if least is not None and (member <= least if exclusive else member < least):
            raise InvalidTaskLimit(field, "minimum", f"must be {'>' if exclusive else '≥'} "
                                                     f"{least:g}, not {member!r}")
        if most is not None and member > most:
            raise InvalidTaskLimit(field, "maximum", f"must be ≤ {most:g}, not {member!r}")
    return {name: float(v) if members[name][0] == "number" else v
            for name, v in value.items() if name in members}


def parse_limit(value: Any) -> TaskLimit:
    """The :class:`TaskLimit` of a JSON value, or :class:`InvalidTaskLimit` naming the member
    and the rule it breaks (``type``, ``minimum``, ``maximum``, ``required``,
    ``unknown_field``)."""
    found = _checked(value, _MEMBERS, "")
    breaker = None
    if "breaker" in value:
        members = _checked(value["breaker"], _BREAKER_MEMBERS, "breaker.")
        if "failure_ratio" not in members:
            raise InvalidTaskLimit("breaker.failure_ratio", "required",
                                   "a breaker needs its failure_ratio")
        breaker = Breaker(**members)
    if "concurrency" not in found and "rate" not in found and breaker is None:
        raise InvalidTaskLimit("concurrency", "required", "give concurrency, rate or breaker")
    limit = object.__new__(TaskLimit)
    for name in _MEMBERS:
        object.__setattr__(limit, name, found.get(name))
    object.__setattr__(limit, "breaker", breaker)
    return limit


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

    def breaker_state(self, queue: str, task_type: str) -> str:
        """``closed``, ``open`` or ``half_open``: the breaker of ``task_type`` on ``queue``
        as ``read.lua`` last left it (``closed`` before it first looked)."""
        state = self.client.hget(self.settings.keys.queue(queue).breaker(task_type), "state")
        return "closed" if state is None else as_text(state)

    def remove(self, queue: str, task_type: str) -> bool:
        """Lift the limits of ``task_type`` on ``queue``; False if it had none."""
        return bool(self.client.hdel(self.settings.keys.queue(queue).limits, task_type))
