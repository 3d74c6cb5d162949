"""The figures of a drill, counted from what the producer published and the tasks recorded.

* **lost**: a published task whose order never had an effect (those the broker
  dead-lettered are counted among them, and also reported apart).
* **duplicate effects**: effects of an order beyond its first. Each gets a cause, from
  how the attempt that made the earlier effect ended: *killed* when it never ended
  (no success, failure or retry recorded, or only a peer handler's ``returned``, the
  kill coming before the next effect) because the drill SIGKILLed its worker after the
  effect (on envelope:// the window between an effect and its done marker, which no
  broker closes unless the effect and the marker are one transaction); *worker
  exited* when its worker exited on its own instead; *failed after its effect* (with
  the error) or *succeeded, then delivered again* when it ended; *concurrent* when the
  next run began before the effect.
* **redelivered starts**: starts of a task beyond its first (``task_prerun``).
* **body reruns**: task bodies that ran again for an order that had already run.
* **started early**: delayed tasks whose first start came before their countdown ran
  out (counted from the moment ``apply_async`` was called, less 50 ms of clock slack).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.drill.brokers import DeadLetterRecord
from bench.drill.ledger import Record
from bench.drill.producer import NotPublished, Published

#: Clock slack allowed before a delayed task counts as started early (seconds).
EARLY_SLACK_S = 0.05
#: Cause of a duplicate effect that only a transaction around effect and marker prevents.
KILLED = "SIGKILLed after its effect, before the attempt ended"
#: Outcome of a Go, Node.js or Java handler that returned: its SDK writes the done marker
#: and acknowledges afterwards, so the attempt has not ended yet (Celery's ``success``
#: comes after its done marker).
RETURNED = "returned"


@dataclass(frozen=True)
class Duplicate:
    """An order whose effect happened more than once; one cause per extra effect."""

    order_id: str
    effects: list[Record]
    causes: list[str]

    @property
    def extra(self) -> int:
        """Effects beyond the first."""
        return len(self.effects) - 1

    @property
    def after_kill(self) -> int:
        """Extra effects explained by a kill after the earlier effect."""
        return self.causes.count(KILLED)


@dataclass
class Tally:
    """Counts and the evidence behind them."""

    published: int
    not_published: int
    effects: int
    lost: list[str]  # order ids
    lost_dead_lettered: int
    duplicates: list[Duplicate]
    deliveries: int
    redelivered_starts: int
    body_runs: int
    body_reruns: int
    dead_lettered: int
    celery_failures: int
    runs_without_key: int
    effects_of_unpublished: list[str]
    starts_cut_by_kills: int
    started_early: int = 0
    history: dict[str, list[str]] = field(default_factory=dict)
    #: Per worker hostname: starts, and effects of published orders.
    starts_by_host: Counter[str] = field(default_factory=Counter)
    effects_by_host: Counter[str] = field(default_factory=Counter)

    def by_language(self, language_of: dict[str, str]) -> dict[str, dict[str, int]]:
        """Starts, effects and duplicate effects per worker language (``language_of``:
        hostname -> language); a duplicate counts for the worker that made it."""
        split: dict[str, Counter[str]] = defaultdict(Counter)
        for host, n in self.starts_by_host.items():
            split[language_of.get(host, "?")]["starts"] += n
        for host, n in self.effects_by_host.items():
            split[language_of.get(host, "?")]["effects"] += n
        for dup in self.duplicates:
            for effect in dup.effects[1:]:
                split[language_of.get(str(effect.get("host")), "?")]["duplicate_effects"] += 1
        return {language: {kind: counts[kind]
                           for kind in ("starts", "effects", "duplicate_effects")}
                for language, counts in sorted(split.items())}

    @property
    def duplicate_effects(self) -> int:
        """Effects beyond each order's first."""
        return sum(d.extra for d in self.duplicates)

    @property
    def duplicates_after_kill(self) -> int:
        """Duplicate effects explained by a kill after the earlier effect."""
        return sum(d.after_kill for d in self.duplicates)

    @property
    def passed(self) -> bool:
        """No task lost, and no effect duplicated but by a kill after the effect.

        A worker SIGKILLed after a task's effect and before its attempt ended (its
        done marker written, its entry acknowledged) leaves an attempt nobody saw
        succeed: the broker must deliver it again, and only an effect that is one
        transaction with its done marker (or is itself conditional on the key) can
        tell. Those are reported (``duplicate_effects_after_kill``), not failed;
        every other duplicate is a broken promise.
        """
        return not self.lost and self.duplicate_effects == self.duplicates_after_kill

    def figures(self) -> dict[str, Any]:
        """The counts, as reported."""
        return {
            "published": self.published, "not_published": self.not_published,
            "effects": self.effects, "lost": len(self.lost),
            "lost_dead_lettered": self.lost_dead_lettered,
            "duplicate_effects": self.duplicate_effects,
            "duplicate_effects_after_kill": self.duplicates_after_kill,
            "duplicated_orders": len(self.duplicates), "deliveries": self.deliveries,
            "redelivered_starts": self.redelivered_starts, "body_runs": self.body_runs,
            "body_reruns": self.body_reruns, "dead_lettered": self.dead_lettered,
            "celery_failures": self.celery_failures, "runs_without_key": self.runs_without_key,
            "effects_of_unpublished": len(self.effects_of_unpublished),
            "starts_cut_by_kills": self.starts_cut_by_kills, "started_early": self.started_early,
        }


def _by(records: Iterable[Record], name: str) -> dict[str, list[Record]]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        grouped[str(record.get(name))].append(record)
    return grouped


def _ending(outcomes: list[Record], effect: Record) -> Record | None:
    """How the attempt that made ``effect`` ended, if it recorded it."""
    return next((o for o in sorted(outcomes, key=lambda o: o["t"])
                 if o["pid"] == effect["pid"] and o["t"] >= effect["t"]), None)


def _cause(effect: Record, later: Record, runs: list[Record], outcomes: list[Record],
           killed_at: dict[str, float], exited_at: dict[str, float]) -> str:
    """Why the effect after ``effect`` (``later``) happened at all."""
    began = max((r["t"] for r in runs if r["pid"] == later["pid"]
                 and r["task"] == later["task"] and r["t"] <= later["t"]), default=None)
    if began is not None and began < effect["t"]:
        return "concurrent: the next run began before this effect"
    ending = _ending(outcomes, effect)
    host = str(effect.get("host"))
    if ending is None:
        if killed_at.get(host, -1.0) >= effect["t"]:
            return KILLED
        if exited_at.get(host, -1.0) >= effect["t"]:
            return "its worker exited on its own before the attempt ended"
        return "the attempt never ended"
    if ending.get("state") == RETURNED:  # settled by the SDK after the handler returned
        if effect["t"] <= killed_at.get(host, -1.0) <= later["t"]:
            return KILLED
        return "its handler returned, then it was delivered again"
    if ending.get("state") == "failure":
        error = str(ending.get("error") or "").split(":", 1)[0]
        return f"failed after its effect: {error}" if error else "failed after its effect"
    if ending.get("state") == "retry":
        return "retried after its effect"
    return "succeeded, then delivered again"


def tally(published: list[Published], not_published: list[NotPublished],
          records: dict[str, list[Record]], dead_letters: list[DeadLetterRecord],
          killed_at: dict[str, float], exited_at: dict[str, float] | None = None) -> Tally:
    """Count a drill; ``killed_at`` and ``exited_at``: hostname -> when the drill SIGKILLed
    that worker, or saw that it had exited on its own."""
    exited_at = exited_at or {}
    deliveries, runs = records["deliveries"], records["runs"]
    effects, outcomes = records["effects"], records["outcomes"]
    outcomes_of = _by(outcomes, "task")
    effects_of = _by(effects, "order")
    order_of_task = {p.task.task_id: p.task.order_id for p in published}
    published_orders = set(order_of_task.values())
    dead_tasks = {d.task_id for d in dead_letters}

    lost = sorted(order for order in published_orders if order not in effects_of)
    lost_tasks = {task for task, order in order_of_task.items() if order in lost}
    duplicates = []
    for order, found in sorted(effects_of.items()):
        if len(found) > 1:
            found = sorted(found, key=lambda r: r["t"])
            runs_of = [r for r in runs if r.get("order") == order]
            causes = [_cause(e, later, runs_of, outcomes_of[str(e["task"])], killed_at,
                             exited_at) for e, later in itertools.pairwise(found)]
            duplicates.append(Duplicate(order, found, causes))

    starts = Counter(str(r["task"]) for r in deliveries)
    ran = Counter(str(r["order"]) for r in runs)
    cut = sum(1 for r in deliveries if str(r.get("host")) in killed_at
              and killed_at[str(r["host"])] >= r["t"]
              and not any(o["pid"] == r["pid"] and o["t"] >= r["t"]
                          for o in outcomes_of[str(r["task"])]))

    first_start: dict[str, float] = {}
    for record in deliveries:
        task = str(record["task"])
        first_start[task] = min(first_start.get(task, record["t"]), record["t"])
    early = sum(1 for p in published if p.due is not None
                and first_start.get(p.task.task_id, float("inf")) < p.due - EARLY_SLACK_S)

    suspects = set(lost) | {d.order_id for d in duplicates}
    history = {order: _history(order, records) for order in sorted(suspects)}
    return Tally(
        published=len(published), not_published=len(not_published),
        effects=sum(1 for order in published_orders if order in effects_of),
        lost=lost, lost_dead_lettered=len(lost_tasks & dead_tasks),
        duplicates=duplicates, deliveries=len(deliveries),
        redelivered_starts=sum(n - 1 for n in starts.values()),
        body_runs=len(runs), body_reruns=sum(n - 1 for n in ran.values()),
        dead_lettered=len(dead_letters),
        celery_failures=sum(1 for o in outcomes if o.get("state") == "failure"),
        runs_without_key=sum(1 for r in runs if not r.get("key")),
        effects_of_unpublished=sorted(set(effects_of) - published_orders),
        starts_cut_by_kills=cut, started_early=early, history=history,
        starts_by_host=Counter(str(r.get("host")) for r in deliveries),
        effects_by_host=Counter(str(r.get("host")) for r in effects
                                if r.get("order") in published_orders),
    )


def _history(order: str, records: dict[str, list[Record]]) -> list[str]:
    """Every record about ``order`` (and its task ids), in time order, one line each."""
    tasks = {str(r["task"]) for kind in ("deliveries", "runs", "effects")
             for r in records[kind] if r.get("order") == order}
    lines = []
    for kind in ("deliveries", "runs", "effects", "outcomes"):
        for record in records[kind]:
            if record.get("order") == order or str(record.get("task")) in tasks:
                extra = {k: v for k, v in record.items() if k not in ("t", "pid", "host")}
                lines.append((record["t"], f"{kind[:-1] if kind != 'deliveries' else 'start'}"
                              f" {record.get('host')} pid {record.get('pid')} {extra}"))
    return [f"{t:.3f} {text}" for t, text in sorted(lines)]
