"""The figures of a drill, counted from what the producer published and the tasks recorded.

* **lost**: a published task whose order never had an effect (those the broker
  dead-lettered are counted among them, and also reported apart).
* **duplicate effects**: effects of an order beyond its first. Each is also classed:
  *after a kill* when the attempt that made the earlier effect never ended (no
  success, failure or retry recorded for it) because its worker was SIGKILLed after
  the effect: the window between an effect and its done marker, which no broker
  closes unless the effect and the marker are one transaction. Every other one is
  *unexplained*.
* **redelivered starts**: starts of a task beyond its first (``task_prerun``).
* **body reruns**: task bodies that ran again for an order that had already run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.drill.brokers import DeadLetterRecord
from bench.drill.ledger import Record
from bench.drill.producer import NotPublished, Published


@dataclass(frozen=True)
class Duplicate:
    """An order whose effect happened more than once."""

    order_id: str
    effects: list[Record]
    after_kill: int  # extra effects explained by a kill after the earlier effect

    @property
    def extra(self) -> int:
        """Effects beyond the first."""
        return len(self.effects) - 1


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
    history: dict[str, list[str]] = field(default_factory=dict)

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
        """No task lost and no effect duplicated."""
        return not self.lost and not self.duplicates

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
            "starts_cut_by_kills": self.starts_cut_by_kills,
        }


def _by(records: Iterable[Record], name: str) -> dict[str, list[Record]]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        grouped[str(record.get(name))].append(record)
    return grouped


def _ended(outcomes: list[Record], effect: Record) -> bool:
    """Whether the attempt that made ``effect`` recorded how it ended."""
    return any(o["pid"] == effect["pid"] and o["t"] >= effect["t"] for o in outcomes)


def _explained_by_kill(effect: Record, outcomes: list[Record],
                       killed_at: dict[str, float]) -> bool:
    at = killed_at.get(str(effect.get("host")))
    return at is not None and at >= effect["t"] and not _ended(outcomes, effect)


def tally(published: list[Published], not_published: list[NotPublished],
          records: dict[str, list[Record]], dead_letters: list[DeadLetterRecord],
          killed_at: dict[str, float]) -> Tally:
    """Count a drill; ``killed_at``: hostname -> when the drill SIGKILLed that worker."""
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
            after_kill = sum(_explained_by_kill(e, outcomes_of[str(e["task"])], killed_at)
                             for e in found[:-1])
            duplicates.append(Duplicate(order, found, after_kill))

    starts = Counter(str(r["task"]) for r in deliveries)
    ran = Counter(str(r["order"]) for r in runs)
    cut = sum(1 for r in deliveries if str(r.get("host")) in killed_at
              and killed_at[str(r["host"])] >= r["t"]
              and not any(o["pid"] == r["pid"] and o["t"] >= r["t"]
                          for o in outcomes_of[str(r["task"])]))

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
        starts_cut_by_kills=cut, history=history,
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
