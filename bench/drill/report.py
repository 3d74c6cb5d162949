"""The outcome of one drill: figures, whether it passed, and the evidence when it did not."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from bench.drill.brokers import DeadLetterRecord
from bench.drill.config import DrillConfig
from bench.drill.faults import Timeline
from bench.drill.producer import NotPublished, Published
from bench.drill.tally import Tally
from bench.drill.workers import DrillWorker

#: Worker log lines worth reporting, and what makes two of them the same line.
_ERROR_LINE = re.compile(r"ERROR|CRITICAL|Unrecoverable|Traceback|Error:|WARNING")
_NOISE = re.compile(r"^\[[^\]]*\]\s*|\b[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}\b"
                    r"|\b0x[0-9a-f]+\b|\b[0-9a-f]*\d[0-9a-f]*\b|\d+")
_EXIT_LINE = re.compile(r"Unrecoverable error|CRITICAL")
#: How many lost or duplicated orders the diagnostics describe one by one.
DETAILED = 5
#: Replication lag the loss window allows before a primary's SIGKILL (seconds): Redis
#: sends every write to its replicas as it applies it, so only the last moments' are
#: in flight when it dies.
LOSS_LOOKBACK_S = 1.0


def _same(line: str) -> str:
    return _NOISE.sub("#", line.strip())[:200]


def exit_reason(worker: DrillWorker) -> str:
    """The last fatal line of a worker that exited on its own."""
    try:
        text = worker.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    lines = [line for line in text.splitlines() if _EXIT_LINE.search(line)]
    return _same(lines[-1]) if lines else f"no fatal line; status {worker.exit_code()}"


def log_problems(workers: list[DrillWorker]) -> Counter[str]:
    """Error and warning lines of the workers' logs, counted once digits and ids are gone."""
    found: Counter[str] = Counter()
    for worker in workers:
        try:
            text = worker.log_path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if _ERROR_LINE.search(line):
                found[_same(line)] += 1
    return found


@dataclass
class DrillReport:
    """Everything one drill found."""

    config: DrillConfig
    broker: str
    tally: Tally
    timeline: Timeline
    seconds: float
    drain_s: float | None
    published: list[Published]
    not_published: list[NotPublished]
    dead_letters: list[DeadLetterRecord]
    leftovers: dict[str, int]
    killed: list[DrillWorker]
    exited: list[DrillWorker]
    log_problems: Counter[str]
    harness_errors: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    #: Cluster drills: each fault's (began, Cluster whole again), epoch seconds.
    fault_spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Cluster drills: per fault that loses writes, the queues of its primary.
    lossy_queues: dict[str, list[str]] = field(default_factory=dict)
    #: Every worker's hostname -> its language.
    languages: dict[str, str] = field(default_factory=dict)
    #: Sentinel: per fault (kill, stall), seconds until a new primary took writes.
    failover_s: dict[str, float] = field(default_factory=dict)
    #: Per fault, seconds until the first effect of a task published after it.
    recovery_s: dict[str, float | None] = field(default_factory=dict)
    #: Sentinel: per fault, replication bytes the best replica lacked just before it.
    lag_bytes: dict[str, int | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """The drill ran as designed, and lost nothing and duplicated no effect.

        On a Cluster, without ``WAIT``, the writes a SIGKILLed primary had not yet sent
        to its replica are lost with it, and those a SIGSTOPped one took before its
        demotion: a publish (the task is lost) or a done marker with its acknowledgement
        (the redelivery runs the task again). The drill passes when every lost task and
        every duplicated effect is one of those (:meth:`lost_outside_window` and
        :meth:`duplicated_outside_window` are empty). On Sentinel without WAIT a loss is
        reported, not failed (the replicas may not have copied the last writes), and any
        worker that exited fails the drill.
        """
        tally = self.tally
        if self.harness_errors:
            return False
        if self.fault_spans:
            return not self.lost_outside_window() and not self.duplicated_outside_window()
        if tally.duplicate_effects != tally.duplicates_after_kill:
            return False
        if self.config.sentinel:
            return not self.exited and (self.config.loss_allowed or not tally.lost)
        return tally.passed

    def _in_window(self, order: str, at: float) -> bool:
        """Whether a write for ``order`` at ``at`` went to a queue of the SIGKILLed or
        SIGSTOPped primary from :data:`LOSS_LOOKBACK_S` before that fault until the
        Cluster was whole again (the no-WAIT window: writes its replica had not copied,
        or that it took while stalled)."""
        published = self.published_by_order.get(order)
        return published is not None and any(
            fault in self.fault_spans and published.task.queue in queues
            and self.fault_spans[fault][0] - LOSS_LOOKBACK_S <= at <= self.fault_spans[fault][1]
            for fault, queues in self.lossy_queues.items())

    @cached_property
    def published_by_order(self) -> dict[str, Published]:
        """Each published task, by its order id."""
        return {p.task.order_id: p for p in self.published}

    def lost_in_window(self) -> list[str]:
        """Lost orders published in the no-WAIT window of a primary's loss."""
        return [order for order in self.tally.lost
                if self._in_window(order, self.published_by_order[order].at)]

    def lost_outside_window(self) -> list[str]:
        """Lost orders no primary's death explains."""
        explained = set(self.lost_in_window())
        return [order for order in self.tally.lost if order not in explained]

    def duplicated_in_window(self) -> list[str]:
        """Orders duplicated otherwise than by a kill after the effect, every earlier
        effect of which came in the no-WAIT window of a primary's loss: its done marker
        and acknowledgement, written then, may be lost with the primary."""
        return [d.order_id for d in self.tally.duplicates if d.extra > d.after_kill
                and all(self._in_window(d.order_id, e["t"]) for e in d.effects[:-1])]

    def duplicated_outside_window(self) -> list[str]:
        """Orders duplicated otherwise than by a kill after the effect, that no
        primary's death explains."""
        explained = set(self.duplicated_in_window())
        return [d.order_id for d in self.tally.duplicates
                if d.extra > d.after_kill and d.order_id not in explained]

    def whole_again_s(self) -> dict[str, float]:
        """Per Cluster fault: seconds from its start to the Cluster whole again."""
        return {kind: round(end - began, 1) for kind, (began, end) in self.fault_spans.items()}

    def _outage(self) -> tuple[float, float] | None:
        down, up = self.timeline.of("redis-kill"), self.timeline.of("redis-start")
        return (down[0].at, up[0].at) if down and up else None

    def figures(self) -> dict[str, Any]:
        """The figures docs/operations.md reports."""
        outage = self._outage()
        return {
            "broker": self.broker, **self.tally.figures(),
            "published_during_outage": 0 if outage is None else sum(
                1 for p in self.published if outage[0] <= p.at < outage[1]),
            "publish_max_s": round(max((p.seconds for p in self.published), default=0), 2),
            "worker_kills": len(self.killed), "worker_exits": len(self.exited),
            "redis_restarts": len(self.timeline.of("redis-start")),
            "seconds": round(self.seconds, 1),
            "drain_s": None if self.drain_s is None else round(self.drain_s, 1),
            "topology": self.config.topology, "wait_replicas": self.config.wait_replicas,
            "failover_s": self.failover_s, "recovery_s": self.recovery_s,
            "replication_lag_bytes": self.lag_bytes,
            "languages": list(self.config.languages), "burst": self.config.burst,
            "by_language": self.tally.by_language(self.languages),
            **({"whole_again_s": self.whole_again_s(),
                "lost_with_primary": len(self.lost_in_window()),
                "lost_otherwise": len(self.lost_outside_window()),
                "duplicated_with_primary": len(self.duplicated_in_window()),
                "duplicated_otherwise": len(self.duplicated_outside_window())}
               if self.fault_spans else {}),
        }

    def to_json(self) -> dict[str, Any]:
        """JSON form: config, figures, findings."""
        return {"machine": self.machine, "config": self.config.to_json(),
                "figures": self.figures(),
                "passed": self.passed, "harness_errors": self.harness_errors,
                "lost": self.tally.lost,
                "duplicated": {d.order_id: d.extra for d in self.tally.duplicates},
                "dead_letters": [vars(d) for d in self.dead_letters],
                "leftovers": self.leftovers, "timeline": self.timeline.lines(),
                "exit_reasons": dict(self.exit_reasons()),
                "duplicate_causes": dict(self.duplicate_causes()),
                "log_problems": dict(self.log_problems.most_common(30))}

    def exit_reasons(self) -> Counter[str]:
        """Why the workers that exited on their own did, counted."""
        return Counter(exit_reason(worker) for worker in self.exited)

    def duplicate_causes(self) -> Counter[str]:
        """Why the duplicate effects happened, counted."""
        return Counter(cause for dup in self.tally.duplicates for cause in dup.causes)

    def summary(self) -> str:
        """The figures in a few lines."""
        f = self.figures()
        verdict = "PASSED" if self.passed else "FAILED"
        return "\n".join([
            f"fault drill on {self.broker}: {verdict}",
            f"  published {f['published']} of {self.config.tasks + self.config.burst} "
            f"({self.config.delayed} with a countdown, {self.config.burst} in the burst), "
            f"not published {f['not_published']}; "
            f"{f['published_during_outage']} publishes began while Redis was down, the "
            f"longest took {f['publish_max_s']} s",
            f"  effects {f['effects']}, lost {f['lost']} (dead-lettered among them "
            f"{f['lost_dead_lettered']}), duplicate effects {f['duplicate_effects']} "
            f"on {f['duplicated_orders']} orders ({f['duplicate_effects_after_kill']} of them "
            "from a SIGKILL after the effect, before the attempt ended)",
            f"  starts {f['deliveries']}, redelivered starts {f['redelivered_starts']}, "
            f"body runs {f['body_runs']}, body reruns {f['body_reruns']}, "
            f"starts cut by kills {f['starts_cut_by_kills']}, delayed tasks started early "
            f"{f['started_early']}",
            f"  dead-lettered {f['dead_lettered']}, Celery failures {f['celery_failures']}, "
            f"runs without idempotency key {f['runs_without_key']}, effects of unpublished "
            f"tasks {f['effects_of_unpublished']}",
            f"  worker kills {f['worker_kills']}, workers exited on their own "
            f"{f['worker_exits']}, Redis restarts {f['redis_restarts']}; "
            f"{f['seconds']} s in all, last effect {f['drain_s']} s after the last publish",
            f"  topology {f['topology']}, wait_replicas {f['wait_replicas']}; new primary "
            f"after {f['failover_s'] or '-'}; first effect of a task published after each "
            f"fault after {f['recovery_s'] or '-'} s; replication lag just before each "
            f"fault {f['replication_lag_bytes'] or '-'} bytes"
            + (" (loss reported, not failed: no WAIT)" if self.config.loss_allowed else ""),
            *([f"  Cluster: {f['lost_with_primary']} lost with the SIGKILLed primary (the "
               f"replication window), {f['lost_otherwise']} lost otherwise; "
               f"{f['duplicated_with_primary']} duplicated with it, "
               f"{f['duplicated_otherwise']} otherwise; whole again after "
               + ", ".join(f"{kind} {s} s" for kind, s in f["whole_again_s"].items())]
              if self.fault_spans else []),
            "  by language: " + "; ".join(
                f"{language} starts {n['starts']}, effects {n['effects']}, duplicate effects "
                f"{n['duplicate_effects']}" for language, n in f["by_language"].items()),
            *(f"  duplicate: {n} x {cause}" for cause, n in self.duplicate_causes().most_common()),
            *(f"  exited: {n} x {reason}" for reason, n in self.exit_reasons().most_common()),
        ])

    def diagnostics(self) -> str:
        """Why the drill failed: ids, histories, dead letters, logs, timeline."""
        parts = [self.summary()]
        if self.harness_errors:
            parts.append("the drill did not run as designed:\n  "
                         + "\n  ".join(self.harness_errors))
        task_of = {p.task.order_id: p for p in self.published}
        if self.tally.lost:
            parts.append(f"lost orders ({len(self.tally.lost)}): "
                         + " ".join(self.tally.lost[:200]))
            for order in self.tally.lost[:DETAILED]:
                p = task_of[order]
                head = (f"  {order} task {p.task.task_id} published at "
                        f"+{p.at - self.timeline.started:.1f}s countdown {p.task.countdown}")
                parts.append("\n    ".join([head, *self.tally.history.get(order, [])]))
        if self.tally.duplicates:
            parts.append("duplicated orders: " + " ".join(
                f"{d.order_id}x{len(d.effects)}" for d in self.tally.duplicates[:200]))
            for dup in self.tally.duplicates[:DETAILED]:
                parts.append("\n    ".join([f"  {dup.order_id}: {'; '.join(dup.causes)}",
                                            *self.tally.history.get(dup.order_id, [])]))
        if self.not_published:
            parts.append("not published:\n  " + "\n  ".join(
                f"{n.task.order_id} {n.error}" for n in self.not_published[:20]))
        if self.dead_letters:
            reasons = Counter(f"{d.failure_class}: {d.reason[:160]}" for d in self.dead_letters)
            parts.append("dead letters:\n  " + "\n  ".join(
                f"{count} x {reason}" for reason, count in reasons.most_common(10)))
        parts.append(f"left in the broker: {self.leftovers}")
        if self.log_problems:
            parts.append("worker log lines (count x line, digits and ids as #):\n  "
                         + "\n  ".join(f"{n} x {line}"
                                       for line, n in self.log_problems.most_common(25)))
        for worker in self.exited:
            parts.append(f"--- {worker.hostname} exited with status {worker.exit_code()} "
                         f"---\n{worker.log_tail(3000)}")
        parts.append("timeline:\n  " + "\n  ".join(self.timeline.lines()))
        return "\n\n".join(parts)
