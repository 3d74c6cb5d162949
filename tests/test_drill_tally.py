"""How the fault drill counts (``bench.drill.tally``): each kind of failure it must catch.

The records are what the drill's tasks write (``bench/drill/ledger.py``); here they are
written out by hand, one story per order, so that every count can be checked exactly.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.drill.brokers import DeadLetterRecord
from bench.drill.config import SMALL_CLUSTER
from bench.drill.faults import Timeline
from bench.drill.ledger import KINDS
from bench.drill.producer import NotPublished, Planned, Published
from bench.drill.report import DrillReport
from bench.drill.tally import tally

KILLED_AT = 100.0  # when the drill SIGKILLed worker "w2"
EXITED_AT = 70.0  # when worker "w4" exited on its own


def planned(n: int) -> Planned:
    return Planned(n, f"order-{n}", f"task-{n}", None, 100)


class Story:
    """Records of one drill, appended attempt by attempt."""

    def __init__(self) -> None:
        self.records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}

    def attempt(self, n: int, host: str, pid: int, t: float, *, runs: bool = True,
                effect: bool = True, outcome: str | None = "success") -> None:
        base = {"task": f"task-{n}", "host": host, "pid": pid}
        self.records["deliveries"].append({**base, "order": f"order-{n}", "t": t})
        if runs:
            self.records["runs"].append({**base, "order": f"order-{n}", "t": t + 0.01,
                                         "key": f"order-{n}"})
        if runs and effect:
            self.records["effects"].append({**base, "order": f"order-{n}", "t": t + 0.2})
        if outcome is not None:
            error = {"error": "ConnectionError: refused"} if outcome == "failure" else {}
            self.records["outcomes"].append({**base, "state": outcome, "t": t + 0.21, **error})


def test_every_failure_is_counted_and_classed() -> None:
    published = [Published(planned(n), 1.0, 0.01) for n in range(8)]
    not_published = [NotPublished(planned(9), 2.0, "OperationalError: down")]
    story = Story()
    story.attempt(0, "w1", 11, 10.0)  # ran once: fine
    # Started on w2, killed before its effect, run again on w3: redelivered, not duplicated.
    story.attempt(1, "w2", 21, 99.0, effect=False, outcome=None)
    story.attempt(1, "w3", 31, 110.0)
    # Effect on w2, killed before it ended: the window between effect and done marker.
    story.attempt(2, "w2", 22, 99.5, outcome=None)
    story.attempt(2, "w3", 32, 111.0)
    # Effect and a recorded failure (the done marker could not be set), then again.
    story.attempt(3, "w1", 12, 50.0, outcome="failure")
    story.attempt(3, "w3", 31, 112.0)
    # Started, never finished anywhere: lost, and the broker dead-lettered it.
    story.attempt(4, "w2", 21, 99.8, effect=False, outcome=None)
    # Effect on w4, which exited on its own before the attempt ended; then again on w3.
    story.attempt(6, "w4", 41, 69.0, outcome=None)
    story.attempt(6, "w3", 31, 113.0)
    # Two runs at once (the first still running when the second began).
    story.attempt(7, "w1", 12, 80.0)
    story.attempt(7, "w3", 32, 80.1)
    # Order 5 never started at all: lost. Order 9 was not published, yet it ran.
    story.attempt(9, "w1", 11, 60.0)
    # A delivery whose idempotency key was done: started, body not run.
    story.attempt(0, "w3", 33, 120.0, runs=False)

    counted = tally(published, not_published, story.records,
                    [DeadLetterRecord("task-4", "redelivery_limit", "its consumer kept dying")],
                    {"w2": KILLED_AT}, {"w4": EXITED_AT})

    assert not counted.passed
    assert counted.lost == ["order-4", "order-5"]
    assert counted.lost_dead_lettered == 1
    assert [(d.order_id, d.extra, d.after_kill, d.causes) for d in counted.duplicates] == [
        ("order-2", 1, 1, ["SIGKILLed after its effect, before the attempt ended"]),
        ("order-3", 1, 0, ["failed after its effect: ConnectionError"]),
        ("order-6", 1, 0, ["its worker exited on its own before the attempt ended"]),
        ("order-7", 1, 0, ["concurrent: the next run began before this effect"]),
    ]
    assert counted.figures() == {
        "published": 8, "not_published": 1, "effects": 6, "lost": 2,
        "lost_dead_lettered": 1, "duplicate_effects": 4, "duplicate_effects_after_kill": 1,
        "duplicated_orders": 4, "deliveries": 14, "redelivered_starts": 6, "body_runs": 13,
        "body_reruns": 5, "dead_lettered": 1, "celery_failures": 1, "runs_without_key": 0,
        "effects_of_unpublished": 1, "starts_cut_by_kills": 3, "started_early": 0,
    }
    assert counted.effects_of_unpublished == ["order-9"]
    assert set(counted.history) == {f"order-{n}" for n in (2, 3, 4, 5, 6, 7)}
    assert counted.history["order-5"] == []
    assert [line.split()[1:3] for line in counted.history["order-3"]] == [
        ["start", "w1"], ["run", "w1"], ["effect", "w1"], ["outcome", "w1"],
        ["start", "w3"], ["run", "w3"], ["effect", "w3"], ["outcome", "w3"]]


def test_a_delayed_task_that_starts_before_it_is_due_is_counted() -> None:
    due_in_2s = Planned(0, "order-0", "task-0", 2.0, 100)
    published = [Published(due_in_2s, 10.0, 0.01), Published(planned(1), 10.0, 0.01)]
    story = Story()
    story.attempt(0, "w1", 11, 11.5)  # 0.5 s before it was due
    story.attempt(1, "w1", 11, 10.1)  # not delayed: at once is right
    assert tally(published, [], story.records, [], {}).started_early == 1
    story = Story()
    story.attempt(0, "w1", 11, 12.0)
    story.attempt(1, "w1", 11, 10.1)
    assert tally(published, [], story.records, [], {}).started_early == 0


def test_a_clean_drill_passes() -> None:
    published = [Published(planned(n), 1.0, 0.01) for n in range(3)]
    story = Story()
    for n in range(3):
        story.attempt(n, "w1", 11, 10.0 + n)
    counted = tally(published, [], story.records, [], {})
    assert counted.passed
    assert (counted.effects, counted.duplicate_effects, counted.redelivered_starts) == (3, 0, 0)


def test_a_drill_whose_only_duplicate_followed_a_kill_after_the_effect_passes() -> None:
    published = [Published(planned(n), 1.0, 0.01) for n in range(2)]
    story = Story()
    story.attempt(0, "w2", 21, 95.0, outcome=None)  # effect, then SIGKILLed at KILLED_AT
    story.attempt(0, "w1", 11, 110.0)
    story.attempt(1, "w1", 11, 111.0)
    counted = tally(published, [], story.records, [], {"w2": KILLED_AT})
    assert counted.passed
    assert (counted.duplicate_effects, counted.duplicates_after_kill) == (1, 1)


def test_a_peer_handler_that_returned_then_was_killed_is_a_kill_not_a_broken_promise() -> None:
    # A Go, Node.js or Java handler records "returned"; its SDK settles afterwards.
    published = [Published(planned(n), 1.0, 0.01) for n in range(2)]
    story = Story()
    story.attempt(0, "w2", 21, 95.0, outcome="returned")  # SIGKILLed at KILLED_AT, unsettled
    story.attempt(0, "w1", 11, 110.0)
    story.attempt(1, "w3", 31, 96.0, outcome="returned")  # never killed: settled, yet again
    story.attempt(1, "w1", 11, 111.0)
    counted = tally(published, [], story.records, [], {"w2": KILLED_AT})
    assert [(d.order_id, d.causes) for d in counted.duplicates] == [
        ("order-0", ["SIGKILLed after its effect, before the attempt ended"]),
        ("order-1", ["its handler returned, then it was delivered again"]),
    ]
    assert not counted.passed
    assert counted.by_language({"w1": "python", "w2": "go", "w3": "node"}) == {
        "go": {"starts": 1, "effects": 1, "duplicate_effects": 0},
        "node": {"starts": 1, "effects": 1, "duplicate_effects": 0},
        "python": {"starts": 2, "effects": 2, "duplicate_effects": 2},
    }


def test_a_cluster_drill_allows_a_rerun_only_when_its_done_marker_was_in_a_lost_window() -> None:
    """Without WAIT a SIGSTOPped primary loses the writes it took before its demotion:
    a done marker and acknowledgement among them make the redelivery run the task again.
    That duplicate is one of the window's, like a publish lost then; any other fails."""
    published = [Published(Planned(n, f"order-{n}", f"task-{n}", None, 100,
                                   queue="drill-1" if n else "drill"), 1.0, 0.01)
                 for n in range(2)]
    story = Story()
    for n in range(2):  # each ran to its effect and success at 50, then again at 60
        story.attempt(n, "w1", 11, 50.0)
        story.attempt(n, "w2", 21, 60.0)

    def report(stall: tuple[float, float], queues: list[str]) -> DrillReport:
        return DrillReport(
            SMALL_CLUSTER, "envelope", tally(published, [], story.records, [], {}, {}),
            Timeline(), 70.0, 5.0, published, [], [], {}, [], [], Counter(),
            fault_spans={"primary-stall": stall}, lossy_queues={"primary-stall": queues})

    during = report((49.5, 55.0), ["drill-1"])  # order-1's queue was on the stalled primary
    assert (during.duplicated_in_window(), during.duplicated_outside_window()) == \
        (["order-1"], ["order-0"])
    assert not during.passed
    assert report((49.5, 55.0), ["drill", "drill-1"]).passed
    after = report((58.0, 62.0), ["drill", "drill-1"])  # the first effects came before it
    assert after.duplicated_outside_window() == ["order-0", "order-1"]
    assert not after.passed
