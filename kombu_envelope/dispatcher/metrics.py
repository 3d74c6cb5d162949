"""The figures of ``GET /metrics``, read from Redis at scrape time (docs/monitoring/metrics.md).

:class:`RedisCollector` is a ``prometheus_client`` collector: every scrape reads the
queues the registries (docs/protocol.md, section 2) and the announcements (section 15)
name, their streams, delayed sets, dead-letter streams and statistics hashes
(section 17); nothing is kept between scrapes. :func:`render` builds the whole page,
or raises the Redis error that stopped it (never half a page).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis.exceptions import ResponseError

from kombu_envelope.keys import BUCKETS_BY_URGENCY
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import Announcements, WorkerAnnouncement
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.worker_stats import TaskStats, parse_stats

__all__ = ["BACKLOG_COUNT", "CONTENT_TYPE", "DEFAULT_HEARTBEAT_S", "RedisCollector", "render"]

_NS = "kombu_envelope"
#: The content type of the page: the text format every Prometheus reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Most entries one scrape counts in a stream whose group lag Redis does not know.
BACKLOG_COUNT = 10_000
#: The heartbeat period of an announcement without ``heartbeat_ms`` (seconds).
DEFAULT_HEARTBEAT_S = 10.0

_QUEUE_LABELS = ["queue", "bucket", "group"]
_WORKER_LABELS = ["consumer", "language", "host"]
_TASK_LABELS = ["queue", "task_type", "language"]
_COUNTER_HELP = {
    "succeeded": ("tasks_succeeded", "Attempts whose handler returned"),
    "failed": ("tasks_failed", "Attempts whose handler raised, timed out or refused "
               "the payload"),
    "retried": ("tasks_retried", "Retries written with retry_count + 1"),
    "dead": ("tasks_dead_lettered", "Dead-letter entries written by workers"),
    "duplicate": ("tasks_duplicates_skipped", "Entries acknowledged unrun: their "
                  "idempotency key was done"),
}
_HISTOGRAM_HELP = {
    "run": ("task_run_duration_seconds", "How long each attempt's handler ran"),
    "wait": ("task_start_delay_seconds", "How long each attempt waited to start after "
             "it was due (schedule_time, else created_at)"),
}


class RedisCollector(Collector):
    """Collects every figure of the page from Redis when scraped."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape (raises on a Redis error)."""
        began = time.monotonic()
        now_ms = _server_ms(self.client)
        workers = Announcements(self.client, self.settings).workers()
        queues = self._queues(workers)
        families = _QueueFamilies()
        for queue in queues:
            families.add_queue(queue, self._read_queue(queue, now_ms), now_ms)
        yield from families.all()
        yield from _worker_families(queues, workers, now_ms)
        duration = GaugeMetricFamily(f"{_NS}_scrape_duration_seconds",
                                     "How long reading Redis for this page took")
        duration.add_metric([], time.monotonic() - began)
        yield duration

    def _queues(self, workers: list[WorkerAnnouncement]) -> list[str]:
        keys = self.settings.keys
        named: set[str] = set()
        for registry in (keys.queues, keys.dead_queues, keys.periodic_queues):
            named.update(as_text(name) for name in self.client.smembers(registry))
        for worker in workers:
            named.update(worker.queues)
        return sorted(named)

    def _read_queue(self, queue: str, now_ms: int) -> dict[str, Any]:
        """Every reply about ``queue`` one scrape needs: two round trips in the queue's slot
        (one more per stream whose group lag Redis does not know)."""
        keys, group = self.settings.keys.queue(queue), self.settings.consumer_group
        pipe = self.client.pipeline(transaction=False)
        for bucket in BUCKETS_BY_URGENCY:
            pipe.xinfo_groups(keys.stream(bucket))
        pipe.zcard(keys.delayed)
        pipe.zrange(keys.delayed, 0, 0, withscores=True)
        pipe.xlen(keys.dead)
        pipe.hgetall(keys.stats)
        pipe.hkeys(keys.limits)
        *infos, delayed, lowest, dead, stats, limited = pipe.execute(raise_on_error=False)
        for reply in (delayed, lowest, dead, stats, limited):
            if isinstance(reply, Exception):
                raise reply
        found = []
        for bucket, info in zip(BUCKETS_BY_URGENCY, infos):
            if isinstance(info, ResponseError):  # no stream yet: nothing to report
                continue
            if isinstance(info, Exception):
                raise info
            described = next((g for g in info if as_text(g["name"]) == group), None)
            if described is not None:
                found.append((bucket.value, keys.stream(bucket), described))
        types = sorted(as_text(name) for name in limited)
        pipe = self.client.pipeline(transaction=False)
        for _, stream, _ in found:
            pipe.xpending(stream, group)
        for task_type in types:  # slots held (deadline not passed), tasks parked, breaker
            pipe.zcount(keys.running(task_type), f"({now_ms}", "+inf")
            pipe.llen(keys.parked(task_type))
            pipe.hget(keys.breaker(task_type), "state")
        replies = pipe.execute() if found or types else []
        summaries, counts = replies[:len(found)], replies[len(found):]
        return {"limits": [(task_type, *counts[3 * i:3 * i + 3])
                           for i, task_type in enumerate(types)],
                "streams": [(bucket, group, self._backlog(stream, described),
                             int(summary.get("pending") or 0), summary.get("min"))
                            for (bucket, stream, described), summary in zip(found, summaries)],
                "delayed": delayed, "lowest": lowest, "dead": dead,
                "stats": parse_stats(stats)}

    def _backlog(self, stream: str, described: dict[Any, Any]) -> int:
        """The group's ``lag``; when Redis answers nil (entries deleted past the group's
        last delivered id), the entries after that id, counted up to :data:`BACKLOG_COUNT`."""
        lag = described.get("lag")
        if lag is not None:
            return int(lag)
        last = as_text(described["last-delivered-id"])
        return len(self.client.xrange(stream, f"({last}", "+", count=BACKLOG_COUNT))


#: What ``limit_breaker_open`` reports for each breaker state.
_BREAKER_VALUES = {"closed": 0.0, "half_open": 0.5, "open": 1.0}


class _QueueFamilies:
    """The queue and statistics families of one scrape, filled queue by queue."""

    def __init__(self) -> None:
        self.backlog = GaugeMetricFamily(
            f"{_NS}_queue_backlog_entries", "Entries not yet delivered to the group",
            labels=_QUEUE_LABELS)
        self.pending = GaugeMetricFamily(
            f"{_NS}_queue_pending_entries", "Entries delivered and not acknowledged",
            labels=_QUEUE_LABELS)
        self.oldest = GaugeMetricFamily(
            f"{_NS}_queue_oldest_pending_age_seconds",
            "Age of the oldest entry delivered and not acknowledged (0 when none)",
            labels=_QUEUE_LABELS)
        self.delayed = GaugeMetricFamily(f"{_NS}_queue_delayed_tasks",
                                         "Tasks in the delayed set", labels=["queue"])
        self.lateness = GaugeMetricFamily(
            f"{_NS}_queue_promotion_lateness_seconds",
            "How long the earliest delayed task is overdue (0 when none is)", labels=["queue"])
        self.dead = GaugeMetricFamily(f"{_NS}_queue_dead_letters",
                                      "Entries in the dead-letter stream", labels=["queue"])
        self.slots = GaugeMetricFamily(
            f"{_NS}_limit_running_attempts",
            "Concurrency slots of a limited task type held now", labels=["queue", "task_type"])
        self.parked = GaugeMetricFamily(
            f"{_NS}_limit_parked_tasks", "Tasks waiting for their type's limits",
            labels=["queue", "task_type"])
        self.breaker = GaugeMetricFamily(
            f"{_NS}_limit_breaker_open",
            "Circuit breaker of the task type: 0 closed, 0.5 half-open, 1 open",
            labels=["queue", "task_type"])
        self.counters = {name: CounterMetricFamily(f"{_NS}_{metric}", text, labels=_TASK_LABELS)
                         for name, (metric, text) in _COUNTER_HELP.items()}
        self.histograms = {name: HistogramMetricFamily(f"{_NS}_{metric}", text,
                                                       labels=_TASK_LABELS)
                           for name, (metric, text) in _HISTOGRAM_HELP.items()}

    def add_queue(self, queue: str, read: dict[str, Any], now_ms: int) -> None:
        for bucket, group, backlog, pending, smallest in read["streams"]:
            labels = [queue, bucket, group]
            self.backlog.add_metric(labels, backlog)
            self.pending.add_metric(labels, pending)
            age_ms = now_ms - int(as_text(smallest).split("-")[0]) if smallest else 0
            self.oldest.add_metric(labels, max(0, age_ms) / 1000)
        self.delayed.add_metric([queue], read["delayed"])
        lowest = read["lowest"]
        overdue_ms = now_ms - lowest[0][1] if lowest else 0
        self.lateness.add_metric([queue], max(0.0, overdue_ms) / 1000)
        self.dead.add_metric([queue], read["dead"])
        for task_type, running, parked, breaker in read["limits"]:
            self.slots.add_metric([queue, task_type], running)
            self.parked.add_metric([queue, task_type], parked)
            if breaker is not None:
                self.breaker.add_metric([queue, task_type],
                                        _BREAKER_VALUES.get(as_text(breaker), 0.0))
        for stats in read["stats"]:
            self._add_stats(queue, stats)

    def _add_stats(self, queue: str, stats: TaskStats) -> None:
        labels = [queue, stats.task_type, stats.language]
        for name, counter in self.counters.items():
            counter.add_metric(labels, stats.counters[name])
        for name, family in self.histograms.items():
            histogram = stats.histograms[name]
            buckets = [("+Inf" if bound == "inf" else bound, float(count))
                       for bound, count in histogram.buckets]
            family.add_metric(labels, buckets, histogram.sum_s)

    def all(self) -> Iterator[Metric]:
        yield from (self.backlog, self.pending, self.oldest, self.delayed, self.lateness,
                    self.dead, self.slots, self.parked, self.breaker, *self.counters.values(),
                    *self.histograms.values())


def _worker_families(queues: list[str], workers: list[WorkerAnnouncement],
                     now_ms: int) -> Iterator[Metric]:
    live = GaugeMetricFamily(f"{_NS}_workers", "Live workers announcing the queue",
                             labels=["queue", "language"])
    counted: dict[tuple[str, str], int] = {}
    for worker in workers:
        for queue in worker.queues:
            key = (queue, worker.language)
            counted[key] = counted.get(key, 0) + int(worker.live)
    for (queue, language), count in sorted(counted.items()):
        live.add_metric([queue, language], count)
    yield live
    up = GaugeMetricFamily(f"{_NS}_worker_up", "1 while the worker's liveness key exists",
                           labels=_WORKER_LABELS)
    seen = GaugeMetricFamily(f"{_NS}_worker_last_seen_seconds",
                             "Time since the worker last announced itself",
                             labels=_WORKER_LABELS)
    period = GaugeMetricFamily(f"{_NS}_worker_heartbeat_period_seconds",
                               "How often the worker announces itself", labels=_WORKER_LABELS)
    for worker in workers:
        if worker.stopped_at is not None:
            continue
        labels = [worker.consumer, worker.language, worker.host]
        up.add_metric(labels, 1 if worker.live else 0)
        seen_ms = worker.seen_at.timestamp() * 1000 if worker.seen_at else now_ms
        seen.add_metric(labels, max(0.0, now_ms - seen_ms) / 1000)
        heartbeat = worker.heartbeat_ms / 1000 if worker.heartbeat_ms else DEFAULT_HEARTBEAT_S
        period.add_metric(labels, heartbeat)
    yield from (up, seen, period)


def _server_ms(client: Any) -> int:
    """Now on the Redis server (ms), the clock stream ids and scores were written by."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def render(client: Any, settings: Settings) -> bytes:
    """The whole page in Prometheus' text format; raises the Redis error that stopped it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(client, settings))
    return generate_latest(registry)
