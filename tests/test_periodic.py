"""Periodic tasks on the shared scheduler (celery_ext/periodic.py).

Occurrence arithmetic and sync are checked directly; racing schedulers run as
Promoter threads, ``celery envelope scheduler`` subprocesses and Celery
workers (apps/periodic_app.py). Every occurrence has a deterministic task id,
so "published once" is checked by mapping each delivered task id back to its
occurrence: no id twice, no unknown id, no gap between the first and the last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from apps.periodic_app import RECORD, create_app, runs_key
from celery import Celery
from celery.schedules import crontab, maybe_schedule, schedule
from support import wait_for
from support.envelope_streams import envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR, CeleryWorker

from celery_ext.periodic import (
    ENABLED_SETTING,
    PeriodicScheduler,
    entries_of,
    following_occurrence,
    next_occurrence,
    occurrence_task_id,
    periodic_scheduler,
)
from kombu_envelope.codec import decode_body, decode_entry
from kombu_envelope.keys import QueueKeys
from kombu_envelope.settings import Settings
from kombu_envelope.store.promoter import Promoter, redis_now_ms
from kombu_envelope.store.schemas import PayloadSchemas

QUEUE = "celery"
APP = "apps.periodic_app"


def ms(text: str) -> int:
    """Milliseconds since the epoch of an RFC 3339 time."""
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def tz_app(zone: str = "UTC") -> Celery:
    app = Celery("tz", set_as_current=False)
    app.conf.timezone = zone
    return app


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def keys(settings: Settings) -> QueueKeys:
    return settings.keys.queue(QUEUE)


def make_app(redis_url: str, key_prefix: str, schedule_spec: dict[str, Any],
             **kwargs: Any) -> Celery:
    return create_app(envelope_url(redis_url), redis_url, key_prefix, schedule_spec, **kwargs)


@contextlib.contextmanager
def scheduler_of(redis_url: str, key_prefix: str,
                 schedule_spec: dict[str, Any]) -> Iterator[PeriodicScheduler]:
    """A PeriodicScheduler of a periodic_app with ``schedule_spec``, with its own client."""
    app = make_app(redis_url, key_prefix, schedule_spec)
    client = redis.Redis.from_url(redis_url)
    try:
        yield PeriodicScheduler(app, client, Settings(key_prefix=key_prefix))
    finally:
        client.close()
        app.close()


def stored_hash(client: redis.Redis, keys: QueueKeys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.periodic).items()}


def stream_task_ids(client: redis.Redis, keys: QueueKeys) -> list[str]:
    return [decode_entry(fields).task_id
            for stream in keys.task_streams for _, fields in client.xrange(stream)]


def delayed_task_ids(client: redis.Redis, keys: QueueKeys) -> list[str]:
    return [member.decode() for member in client.zrange(keys.delayed, 0, -1)]


def occurrence_indexes(task_ids: list[str], prefix: str, anchors: dict[str, int],
                       step_ms: dict[str, int], span: int = 2000) -> dict[str, list[int]]:
    """Per entry, the occurrence number of each of its task ids, from any occurrence.

    Intervals keep their phase, so every occurrence of an entry is
    ``anchors[name] + k * step_ms[name]``. Fails on a task id that is no occurrence.
    """
    index = {occurrence_task_id(prefix, name, anchor + k * step_ms[name]): (name, k)
             for name, anchor in anchors.items() for k in range(-span, span)}
    unknown = [task_id for task_id in task_ids if task_id not in index]
    assert not unknown, f"task ids that are no occurrence: {unknown}"
    found: dict[str, list[int]] = {name: [] for name in anchors}
    for task_id in task_ids:
        name, k = index[task_id]
        found[name].append(k)
    return {name: sorted(ks) for name, ks in found.items()}


def assert_each_occurrence_once(indexes: list[int], at_least: int) -> None:
    """No occurrence twice, none missing between the first and the last, enough of them."""
    duplicates = [k for k, n in Counter(indexes).items() if n > 1]
    assert not duplicates, f"occurrences published more than once: {duplicates}"
    assert len(indexes) >= at_least, f"only {len(indexes)} occurrences: {indexes}"
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes))), \
        f"occurrences missing in {indexes}"


# ------------------------------------------------------------- occurrences


def test_interval_occurrences_keep_their_phase() -> None:
    every_2s = maybe_schedule(2.0, app=tz_app())
    assert next_occurrence(every_2s, 10_000, 10_000) == 12_000
    assert following_occurrence(every_2s, 12_000, 12_050) == 14_000
    # Late by 7.5 s: the claimed occurrence runs once, the next is the first after now.
    assert following_occurrence(every_2s, 12_000, 19_500) == 20_000
    assert following_occurrence(every_2s, 12_000, 20_000) == 22_000


def test_crontab_occurrences_in_the_app_timezone() -> None:
    quarter = maybe_schedule(crontab(minute="*/15"), app=tz_app())
    assert next_occurrence(quarter, ms("2025-09-11T12:07:30+00:00"),
                           ms("2025-09-11T12:07:30+00:00")) == ms("2025-09-11T12:15:00+00:00")
    assert next_occurrence(quarter, ms("2025-09-11T12:15:00+00:00"),
                           ms("2025-09-11T12:15:00+00:00")) == ms("2025-09-11T12:30:00+00:00")

    nine_in_shanghai = maybe_schedule(crontab(hour=9, minute=0), app=tz_app("Asia/Shanghai"))
    now = ms("2025-09-11T02:00:00+00:00")  # 10:00 in Shanghai: today's 9:00 has passed
    assert next_occurrence(nine_in_shanghai, now, now) == ms("2025-09-12T09:00:00+08:00")

    every_minute = maybe_schedule(crontab(), app=tz_app())
    claimed, now = ms("2025-09-11T12:00:00+00:00"), ms("2025-09-11T12:07:30+00:00")
    assert following_occurrence(every_minute, claimed, now) == ms("2025-09-11T12:08:00+00:00")


def test_occurrence_task_ids_are_deterministic() -> None:
    first = occurrence_task_id("envelope", "report", 1_700_000_000_000)
    assert first == occurrence_task_id("envelope", "report", 1_700_000_000_000)
    assert len({first, occurrence_task_id("envelope", "report", 1_700_000_001_000),
                occurrence_task_id("envelope", "other", 1_700_000_000_000),
                occurrence_task_id("other", "report", 1_700_000_000_000)}) == 4


def test_entries_from_beat_schedule(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("entries", set_as_current=False)
    app.conf.task_routes = {"reports.*": {"queue": "reports"}}
    app.conf.beat_schedule = {
        "tick": {"task": "jobs.tick", "schedule": 1.0},
        "nightly": {"task": "reports.nightly", "schedule": crontab(hour=3, minute=0),
                    "kwargs": {"day": "yesterday"}},
        "urgent": {"task": "jobs.tick", "schedule": timedelta(minutes=5),
                   "options": {"queue": "urgent", "priority": 0}},
        "no-task": {"schedule": 1.0},
        "fingerprint:x": {"task": "jobs.tick", "schedule": 1.0},
        "never": {"task": "jobs.tick", "schedule": 0},
    }
    with caplog.at_level(logging.ERROR, logger="celery_ext.periodic"):
        entries = {entry.name: entry for entry in entries_of(app)}
    assert {name: entry.queue for name, entry in entries.items()} == {
        "tick": "celery", "nightly": "reports", "urgent": "urgent"}
    assert isinstance(entries["tick"].schedule, schedule)
    assert {r.getMessage().split(" left out")[0] for r in caplog.records} == {
        "periodic entry 'no-task'", "periodic entry 'fingerprint:x'", "periodic entry 'never'"}


def test_fingerprint_covers_task_schedule_args_kwargs_and_options() -> None:
    base = {"task": "jobs.tick", "schedule": 1.0, "args": [1], "kwargs": {"k": 1},
            "options": {"priority": 1}}
    variants = [{}, {"task": "jobs.tock"}, {"schedule": 2.0}, {"schedule": crontab()},
                {"args": [2]}, {"kwargs": {"k": 2}}, {"options": {"priority": 2}}]
    prints = []
    for change in variants:
        app = Celery("fp", set_as_current=False)
        app.conf.beat_schedule = {"e": {**base, **change}}
        prints.append(entries_of(app)[0].fingerprint)
    assert len(set(prints)) == len(variants)
    app = Celery("fp", set_as_current=False)
    app.conf.beat_schedule = {"e": dict(base)}
    assert entries_of(app)[0].fingerprint == prints[0]  # stable across processes


def test_enabled_setting(redis_client: redis.Redis, key_prefix: str) -> None:
    app = Celery("enabled", set_as_current=False)
    assert periodic_scheduler(app, redis_client) is None  # nothing to run
    app.conf[ENABLED_SETTING] = True
    assert periodic_scheduler(app, redis_client) is not None  # empty: erases entries
    app.conf.beat_schedule = {"tick": {"task": "jobs.tick", "schedule": 1.0}}
    app.conf[ENABLED_SETTING] = None
    assert periodic_scheduler(app, redis_client) is not None
    app.conf[ENABLED_SETTING] = False
    assert periodic_scheduler(app, redis_client) is None  # celery beat runs them


# -------------------------------------------------------------------- sync


def test_sync_adds_resets_and_removes_entries(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    first = {"a": {"every": 60}, "b": {"every": 60}, "elsewhere": {
        "every": 60, "options": {"queue": "other"}}}
    with scheduler_of(redis_url, key_prefix, first) as scheduler:
        report = scheduler.sync()
        now = redis_now_ms(redis_client)
    assert sorted(report.added) == ["a", "b", "elsewhere"]
    stored = stored_hash(redis_client, keys)
    assert set(stored) == {"a", "b", "fingerprint:a", "fingerprint:b"}
    assert now < int(stored["a"]) <= now + 60_000
    assert redis_client.smembers(settings.keys.periodic_queues) == {b"celery", b"other"}

    # The same schedule again (another worker starting): nothing changes.
    with scheduler_of(redis_url, key_prefix, first) as scheduler:
        report = scheduler.sync()
    assert (report.added, report.reset, report.removed) == ([], [], [])
    assert stored_hash(redis_client, keys) == stored

    # A new definition: "a" changed, "b" and "elsewhere" gone, "c" new.
    redis_client.hset(keys.periodic, "a", "1")  # would be due at once if kept
    second = {"a": {"every": 60, "args": ["changed"]}, "c": {"every": 30}}
    with scheduler_of(redis_url, key_prefix, second) as scheduler:
        report = scheduler.sync()
        fingerprints = {e.name: e.fingerprint for e in scheduler.entries}
    assert (report.added, report.reset, sorted(report.removed)) == (["c"], ["a"],
                                                                  ["b", "elsewhere"])
    stored = stored_hash(redis_client, keys)
    assert set(stored) == {"a", "c", "fingerprint:a", "fingerprint:c"}
    assert int(stored["a"]) > now and stored["fingerprint:a"] == fingerprints["a"]
    assert redis_client.exists(settings.keys.queue("other").periodic) == 0
    assert redis_client.smembers(settings.keys.periodic_queues) == {b"celery"}


def test_an_app_without_entries_leaves_the_schedule_alone_unless_enabled(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    with scheduler_of(redis_url, key_prefix, {"a": {"every": 60}}) as scheduler:
        scheduler.sync()
    other_service = make_app(redis_url, key_prefix, {})
    assert periodic_scheduler(other_service, redis_client) is None
    other_service.conf[ENABLED_SETTING] = True
    emptied = periodic_scheduler(other_service, redis_client)
    assert emptied is not None
    assert emptied.sync().removed == ["a"]
    assert redis_client.exists(keys.periodic) == 0
    other_service.close()


def test_sync_rebuilds_what_redis_lost(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    with scheduler_of(redis_url, key_prefix, {"a": {"every": 60}}) as scheduler:
        scheduler.sync()
        redis_client.delete(keys.periodic, settings.keys.periodic_queues)  # a data loss
        published, next_ms = scheduler.run_due(redis_now_ms(redis_client))
    assert published == 0 and next_ms is not None
    assert set(stored_hash(redis_client, keys)) == {"a", "fingerprint:a"}
    assert redis_client.smembers(settings.keys.periodic_queues) == {b"celery"}


# -------------------------------------------------------------- publishing


def test_a_due_occurrence_is_published_once_with_its_task(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    spec = {"tick": {"every": 1, "args": ["tick"], "options": {"priority": 0}}}
    with scheduler_of(redis_url, key_prefix, spec) as one, \
            scheduler_of(redis_url, key_prefix, spec) as two:
        one.sync()
        due = int(redis_client.hget(keys.periodic, "tick"))
        assert one.run_due(due - 1) == (0, due)  # not yet
        assert one.run_due(due) == (1, due + 1000)
        assert two.run_due(due) == (0, due + 1000)  # claimed already
        assert one.run_due(due + 10) == (0, due + 1000)

    assert redis_client.hget(keys.periodic, "tick") == str(due + 1000).encode()
    task_id = occurrence_task_id(key_prefix, "tick", due)
    assert delayed_task_ids(redis_client, keys) == [task_id]
    assert redis_client.zscore(keys.delayed, task_id) == due
    assert redis_client.sismember(settings.keys.queues, QUEUE)
    bucket, enc, body = redis_client.hget(keys.delayed_data, task_id).split(b"\n", 2)
    envelope = decode_body(enc, body)
    assert bucket == b"high"  # Celery priority 0 is the most urgent
    assert (envelope.task_id, envelope.task_type, envelope.priority) == (task_id, RECORD, 255)
    assert envelope.payload == {"tag": "tick"}
    assert envelope.schedule_time is None
    assert envelope.trace_id


def test_an_occurrence_whose_payload_breaks_its_schema_is_skipped(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys, caplog: pytest.LogCaptureFixture,
) -> None:
    PayloadSchemas(redis_client, settings).register(RECORD, 1, {
        "type": "object", "properties": {"tag": {"type": "integer"}}})
    with scheduler_of(redis_url, key_prefix, {"tick": {"every": 1, "args": ["tick"]}}) as one:
        one.sync()
        due = int(redis_client.hget(keys.periodic, "tick"))
        with caplog.at_level(logging.ERROR, logger="celery_ext.periodic"):
            assert one.run_due(due) == (0, due + 1000)
    assert "cannot build task" in caplog.text and "payload.tag" in caplog.text
    assert delayed_task_ids(redis_client, keys) == []


def test_after_downtime_a_missed_occurrence_runs_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    with scheduler_of(redis_url, key_prefix, {"tick": {"every": 1}}) as scheduler:
        scheduler.sync()
        first = int(redis_client.hget(keys.periodic, "tick"))
        ten_s_later = first + 10_500  # ten occurrences were missed
        assert scheduler.run_due(ten_s_later) == (1, first + 11_000)
    assert delayed_task_ids(redis_client, keys) == [
        occurrence_task_id(key_prefix, "tick", first)]


def test_a_scheduler_with_an_older_definition_publishes_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    with scheduler_of(redis_url, key_prefix, {"tick": {"every": 1}}) as old, \
            scheduler_of(redis_url, key_prefix, {"tick": {"every": 1, "args": ["v2"]}}) as new:
        old.sync()
        new.sync()  # a rolling restart: the newest definition wins
        due = int(redis_client.hget(keys.periodic, "tick"))
        assert old.run_due(due) == (0, None)
        assert new.run_due(due) == (1, due + 1000)
    [task_id] = delayed_task_ids(redis_client, keys)
    _bucket, enc, body = redis_client.hget(keys.delayed_data, task_id).split(b"\n", 2)
    assert decode_body(enc, body).payload == {"tag": "v2"}


def test_three_promoter_threads_publish_each_occurrence_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    spec = {"tick": {"every": 1}, "fast": {"every": 0.25}}
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(scheduler_of(redis_url, key_prefix, spec))
        first.sync()
        anchors = {name: int(redis_client.hget(keys.periodic, name)) for name in spec}
        clients: list[redis.Redis] = []

        def factory() -> redis.Redis:
            clients.append(redis.Redis.from_url(redis_url))
            return clients[-1]

        promoters = []
        for _ in range(3):
            scheduler = stack.enter_context(scheduler_of(redis_url, key_prefix, spec))
            promoters.append(Promoter(factory, settings, jobs=[scheduler]))
        for promoter in promoters:
            promoter.start()
        try:
            time.sleep(5.2)
        finally:
            for promoter in promoters:
                promoter.stop()
            for client in clients:
                client.close()
    delivered = stream_task_ids(redis_client, keys) + delayed_task_ids(redis_client, keys)
    found = occurrence_indexes(delivered, key_prefix, anchors, {"tick": 1000, "fast": 250})
    for name, at_least in (("tick", 4), ("fast", 16)):
        assert found[name][0] == 0  # the first occurrence of the sync is there
        assert_each_occurrence_once(found[name], at_least)
    assert len(delivered) == len(set(delivered))


# ------------------------------------------------------------ real processes


class SchedulerCommand:
    """``celery -A apps.periodic_app envelope scheduler`` as a subprocess logging to a file."""

    def __init__(self, env: dict[str, str]) -> None:
        fd, name = tempfile.mkstemp(prefix="envelope-scheduler-", suffix=".log")
        self.log_path = Path(name)
        paths = [str(TESTS_DIR), str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]
        full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, paths)),
                    "PYTHONUNBUFFERED": "1"}
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", APP, "envelope", "scheduler"],
                cwd=PROJECT_ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self) -> None:
        wait_for(lambda: "promoting delayed tasks" in self.log() or self.proc.poll() is not None,
                 timeout=30, message=self.log)
        assert self.proc.poll() is None, self.log()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)


def app_env(redis_url: str, key_prefix: str, spec: dict[str, Any]) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_REDIS_URL": redis_url,
            "TEST_KEY_PREFIX": key_prefix, "TEST_BEAT_SCHEDULE": json.dumps(spec)}


def test_a_killed_scheduler_loses_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    spec = {"tick": {"every": 0.5}}
    env = app_env(redis_url, key_prefix, spec)
    procs = [SchedulerCommand(env) for _ in range(3)]
    try:
        for proc in procs:
            proc.wait_started()
        wait_for(lambda: redis_client.hexists(keys.periodic, "tick"), timeout=10)
        anchor = int(redis_client.hget(keys.periodic, "tick"))
        wait_for(lambda: len(stream_task_ids(redis_client, keys)) >= 3, timeout=10)
        procs[0].proc.kill()  # SIGKILL: no clean-up at all
        procs[0].proc.wait()
        killed_at = len(stream_task_ids(redis_client, keys))
        wait_for(lambda: len(stream_task_ids(redis_client, keys)) >= killed_at + 4, timeout=10,
                 message=procs[1].log)
    finally:
        for proc in procs:
            proc.close()
    delivered = stream_task_ids(redis_client, keys) + delayed_task_ids(redis_client, keys)
    found = occurrence_indexes(delivered, key_prefix, {"tick": anchor}, {"tick": 500})
    assert_each_occurrence_once(found["tick"], at_least=7)


def test_changing_the_schedule_and_restarting_removes_stale_entries(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys,
) -> None:
    old = {"a": {"every": 3600}, "b": {"every": 3600},
           "other": {"every": 3600, "options": {"queue": "other"}}}
    new = {"a": {"every": 1800}, "c": {"every": 3600}}
    first = SchedulerCommand(app_env(redis_url, key_prefix, old))
    try:
        first.wait_started()
        wait_for(lambda: len(stored_hash(redis_client, keys)) == 4, timeout=10,
                 message=first.log)
    finally:
        first.close()
    before = stored_hash(redis_client, keys)
    second = SchedulerCommand(app_env(redis_url, key_prefix, new))
    try:
        second.wait_started()
        wait_for(lambda: set(stored_hash(redis_client, keys)) == {
            "a", "c", "fingerprint:a", "fingerprint:c"}, timeout=10, message=second.log)
    finally:
        second.close()
    after = stored_hash(redis_client, keys)
    assert after["fingerprint:a"] != before["fingerprint:a"]  # reset with the new interval
    assert redis_client.exists(settings.keys.queue("other").periodic) == 0
    assert redis_client.smembers(settings.keys.periodic_queues) == {b"celery"}


def test_three_workers_run_each_occurrence_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
) -> None:
    spec = {"tick": {"every": 1}}
    env = app_env(redis_url, key_prefix, spec)
    workers = [CeleryWorker(APP, env=env) for _ in range(3)]
    try:
        for worker in workers:
            worker.start(wait_ready=False)
        for worker in workers:
            worker.wait_ready()
        wait_for(lambda: redis_client.hexists(keys.periodic, "tick"), timeout=10)
        anchor = int(redis_client.hget(keys.periodic, "tick"))
        time.sleep(5)
    finally:
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(CeleryWorker.close, workers))
    runs = [item.decode().split() for item in redis_client.lrange(runs_key(key_prefix), 0, -1)]
    assert {tag for tag, _ in runs} == {"tick"}
    found = occurrence_indexes([task_id for _, task_id in runs], key_prefix,
                               {"tick": anchor}, {"tick": 1000})
    assert_each_occurrence_once(found["tick"], at_least=4)
    assert stream_task_ids(redis_client, keys) == []  # every published occurrence ran
