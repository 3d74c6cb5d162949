"""Delayed tasks: the delayed set, the 90-day guard and the shared promoter.

Every test uses its own key prefix; promoters run as threads in this process
or as ``python -m kombu_envelope.scheduler`` subprocesses. Lateness is only
bounded loosely here; its precision is measured by the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_for

from kombu_envelope import Envelope, InvalidEnvelope, Publisher, Settings
from kombu_envelope.envelope import utcnow
from kombu_envelope.errors import InvalidQueueName
from kombu_envelope.keys import Bucket, QueueKeys
from kombu_envelope.store.promoter import Promoter, redis_now_ms
from kombu_envelope.testing.redis_server import PrivateRedisServer

PROJECT_ROOT = Path(__file__).resolve().parent.parent
QUEUE = "jobs"


# ----------------------------------------------------------------- helpers


def envelope(delay_s: float | None = None, **fields: Any) -> Envelope:
    """A task due ``delay_s`` seconds from now (None: not scheduled)."""
    if delay_s is not None:
        fields["schedule_time"] = utcnow() + timedelta(seconds=delay_s)
    fields.setdefault("task_type", "sched.test")
    return Envelope.new(**fields)


def publish_due_now_but_delayed(publisher: Publisher, count: int, chunk: int = 5000) -> set[str]:
    """Put ``count`` tasks in the delayed set, all of them already due; return their ids.

    Publishing "as of" a minute ago sends them to the delayed set even though
    their ``schedule_time`` is now, so a promoter finds them all due at once.
    """
    ids: set[str] = set()
    for start in range(0, count, chunk):
        when = utcnow()
        batch = [
            Envelope.new(task_type="sched.bulk", payload={"n": n}, schedule_time=when)
            for n in range(start, min(start + chunk, count))
        ]
        replies = publisher.publish_many(((QUEUE, env) for env in batch),
                                         now=when - timedelta(minutes=1))
        assert replies == [None] * len(batch)  # delayed, not streamed
        ids.update(env.task_id for env in batch)
    return ids


def stream_len(client: redis.Redis, keys: QueueKeys) -> int:
    """Entries in the task streams of a queue."""
    pipe = client.pipeline(transaction=False)
    for stream in keys.task_streams:
        pipe.xlen(stream)
    return sum(pipe.execute())


def stream_task_ids(client: redis.Redis, keys: QueueKeys) -> list[str]:
    """task_id of every entry of the task streams of a queue, duplicates kept."""
    found = []
    for stream in keys.task_streams:
        start = "-"
        while True:
            entries = client.xrange(stream, start, "+", count=10_000)
            for _entry_id, fields in entries:
                assert fields[b"enc"] == b"json"
                found.append(json.loads(fields[b"body"])["task_id"])
            if len(entries) < 10_000:
                break
            start = "(" + entries[-1][0].decode()
    return found


def delayed_count(client: redis.Redis, keys: QueueKeys) -> int:
    """Tasks waiting in the delayed set; the data hash must agree."""
    pipe = client.pipeline(transaction=True)  # one atomic look while promoters run
    zcard, hlen = pipe.zcard(keys.delayed).hlen(keys.delayed_data).execute()
    assert zcard == hlen, f"delayed set holds {zcard} ids but {hlen} bodies"
    return int(zcard)


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{prefix}:*", count=1000))


@contextlib.contextmanager
def running_promoter(url: str, settings: Settings, **kwargs: Any) -> Iterator[Promoter]:
    """A Promoter thread with its own client, stopped on exit."""
    clients: list[redis.Redis] = []

    def factory() -> redis.Redis:
        clients.append(redis.Redis.from_url(url))
        return clients[-1]

    promoter = Promoter(factory, settings, **kwargs)
    promoter.start()
    try:
        yield promoter
    finally:
        promoter.stop()
        assert promoter._thread is not None and not promoter._thread.is_alive()
        for client in clients:
            client.close()


class SchedulerProcess:
    """``python -m kombu_envelope.scheduler`` as a subprocess logging to a file."""

    def __init__(self, url: str, prefix: str, *extra: str) -> None:
        fd, name = tempfile.mkstemp(prefix="promoter-", suffix=".log")
        self.log_path = Path(name)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kombu_envelope.scheduler", "--url", url,
                 "--key-prefix", prefix, *extra],
                cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def promoted(self) -> int:
        """Tasks this process reported moving (needs ``--log-level DEBUG``)."""
        return sum(int(line.split("promoted ")[1].split()[0])
                   for line in self.log().splitlines() if "promoted " in line)

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def keys(settings: Settings) -> QueueKeys:
    return settings.keys.queue(QUEUE)


@pytest.fixture
def publisher(redis_client: redis.Redis, settings: Settings) -> Publisher:
    return Publisher(redis_client, settings)


# ------------------------------------------------------ publishing delayed


def test_due_task_reaches_its_bucket_stream_on_time(
    redis_url: str, redis_client: redis.Redis, settings: Settings, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    with running_promoter(redis_url, settings):
        task = envelope(1.5, priority=200)  # HIGH bucket
        assert publisher.publish(QUEUE, task) is None
        due = task.schedule_time.timestamp()
        assert redis_client.zscore(keys.delayed, task.task_id) == task.due_ms()

        # Nothing in any stream until it is due.
        while time.time() < due - 0.05:
            assert stream_len(redis_client, keys) == 0
            time.sleep(0.02)

        wait_for(lambda: redis_client.xlen(keys.stream(Bucket.HIGH)) == 1, timeout=5,
                 interval=0.005, message="task not promoted")
        lateness = time.time() - due
        assert -0.05 < lateness < 1.0, f"promoted {lateness:.3f}s after due"
        assert stream_len(redis_client, keys) == 1  # nothing in the other buckets
        assert stream_task_ids(redis_client, keys) == [task.task_id]
        assert delayed_count(redis_client, keys) == 0


def test_past_schedule_time_goes_straight_to_the_stream(
    redis_client: redis.Redis, settings: Settings, keys: QueueKeys, publisher: Publisher,
) -> None:
    task = envelope(-300)
    entry_id = publisher.publish(QUEUE, task)
    assert isinstance(entry_id, str)
    assert stream_task_ids(redis_client, keys) == [task.task_id]
    assert redis_client.exists(keys.delayed, keys.delayed_data) == 0
    assert not redis_client.sismember(settings.keys.queues, QUEUE)


def test_schedule_time_more_than_90_days_ahead_is_refused(
    redis_client: redis.Redis, key_prefix: str, publisher: Publisher,
) -> None:
    too_far = envelope(91 * 24 * 3600)
    fine = envelope(89 * 24 * 3600)
    with pytest.raises(InvalidEnvelope) as caught:
        publisher.publish_many([(QUEUE, fine), (QUEUE, too_far)])
    assert caught.value.fields == ["schedule_time"]
    assert caught.value.rules == ["max_delay"]
    assert keys_under(redis_client, key_prefix) == []  # not even the valid one


def test_custom_max_delay(
    redis_client: redis.Redis, key_prefix: str,
) -> None:
    publisher = Publisher(redis_client, Settings(key_prefix=key_prefix, max_delay_s=60))
    with pytest.raises(InvalidEnvelope) as caught:
        publisher.publish(QUEUE, envelope(120))
    assert caught.value.rules == ["max_delay"]
    assert keys_under(redis_client, key_prefix) == []
    assert publisher.publish(QUEUE, envelope(30)) is None  # within the limit


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        (datetime.now() + timedelta(minutes=5), "timezone_required"),
        ("2030-01-01T10:00:00", "timezone_required"),
        (time.time() + 300, "type"),
        (int(time.time() * 1000) + 300_000, "type"),
    ],
    ids=["naive-datetime", "string-without-offset", "epoch-seconds", "epoch-ms"],
)
def test_ambiguous_schedule_times_are_refused(value: Any, rule: str) -> None:
    with pytest.raises(InvalidEnvelope) as caught:
        Envelope.new(task_type="sched.test", schedule_time=value)
    assert caught.value.fields == ["schedule_time"]
    assert caught.value.rules == [rule]


def test_republishing_a_delayed_task_replaces_it(
    redis_client: redis.Redis, settings: Settings, keys: QueueKeys, publisher: Publisher,
) -> None:
    first = envelope(3600, payload={"version": 1})
    assert publisher.publish(QUEUE, first) is None
    again = first.model_copy(update={"payload": {"version": 2},
                                     "schedule_time": utcnow() + timedelta(seconds=0.2)})
    assert publisher.publish(QUEUE, again) is None
    assert delayed_count(redis_client, keys) == 1
    assert redis_client.zscore(keys.delayed, first.task_id) == again.due_ms()

    time.sleep(0.25)
    promoter = Promoter(lambda: redis_client, settings)
    moved, next_due = promoter.run_once()
    assert (moved, next_due) == (1, None)
    assert stream_task_ids(redis_client, keys) == [first.task_id]
    _, fields = redis_client.xrange(keys.stream(Bucket.NORMAL))[0]
    assert json.loads(fields[b"body"])["payload"] == {"version": 2}


def test_far_future_tasks_stay_delayed(
    redis_url: str, redis_client: redis.Redis, settings: Settings, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    when = utcnow() + timedelta(hours=1)
    publisher.publish_many(
        (QUEUE, Envelope.new(task_type="sched.later", payload={"n": n}, schedule_time=when))
        for n in range(10_000)
    )
    assert redis_client.zcard(keys.delayed) == 10_000
    assert delayed_count(redis_client, keys) == 10_000
    assert stream_len(redis_client, keys) == 0

    moved, next_due = Promoter(lambda: redis_client, settings).run_once()
    assert moved == 0
    expected_due = int(when.timestamp() * 1000)
    assert next_due is not None and abs(next_due - expected_due) <= 1
    with running_promoter(redis_url, settings):
        time.sleep(0.5)
    assert delayed_count(redis_client, keys) == 10_000
    assert stream_len(redis_client, keys) == 0


# ------------------------------------------------------ racing and crashes


def test_three_promoter_threads_deliver_each_task_once(
    redis_url: str, redis_client: redis.Redis, settings: Settings, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    ids = publish_due_now_but_delayed(publisher, 10_000)
    assert delayed_count(redis_client, keys) == 10_000
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(running_promoter(redis_url, settings, batch=100))
        wait_for(lambda: delayed_count(redis_client, keys) == 0, timeout=20,
                 message=lambda: f"{delayed_count(redis_client, keys)} still delayed")
    delivered = stream_task_ids(redis_client, keys)
    assert len(delivered) == 10_000
    assert set(delivered) == ids


def test_three_promoter_processes_deliver_each_task_once(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys, publisher: Publisher,
) -> None:
    procs = [SchedulerProcess(redis_url, key_prefix, "--batch", "100", "--log-level", "DEBUG")
             for _ in range(3)]
    try:
        # Publish only once all three listen, so each burst wakes all of them at once.
        wait_for(lambda: dict(redis_client.pubsub_numsub(settings.keys.wakeup_channel))
                 .get(settings.keys.wakeup_channel.encode()) == 3, timeout=30,
                 message=lambda: "promoters did not subscribe:\n" + procs[0].log())
        ids = publish_due_now_but_delayed(publisher, 10_000, chunk=500)
        wait_for(lambda: stream_len(redis_client, keys) >= 10_000, timeout=20,
                 message=lambda: f"{stream_len(redis_client, keys)} promoted")
        time.sleep(0.2)  # let a late duplicate, if any, show up
    finally:
        for proc in procs:
            proc.stop()
    try:
        assert all(proc.proc.returncode == 0 for proc in procs)
        delivered = stream_task_ids(redis_client, keys)
        assert len(delivered) == 10_000
        assert set(delivered) == ids
        assert delayed_count(redis_client, keys) == 0
        assert sum(proc.promoted() for proc in procs) == 10_000
    finally:
        for proc in procs:
            proc.close()


def test_promoter_killed_mid_drain_loses_and_duplicates_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys, publisher: Publisher,
) -> None:
    total = 50_000
    ids = publish_due_now_but_delayed(publisher, total)
    victim = SchedulerProcess(redis_url, key_prefix, "--batch", "50", "--log-level", "WARNING")
    try:
        deadline = time.monotonic() + 30
        while stream_len(redis_client, keys) == 0:  # SIGKILL as soon as draining began
            assert victim.proc.poll() is None, victim.log()
            assert time.monotonic() < deadline, "promoter never started draining"
            time.sleep(0.001)
        victim.proc.kill()
        victim.proc.wait()
    finally:
        victim.close()

    streamed, waiting = stream_len(redis_client, keys), delayed_count(redis_client, keys)
    assert 0 < streamed < total and waiting > 0, "the kill did not land mid-drain"
    assert streamed + waiting == total

    with running_promoter(redis_url, settings, batch=1000):
        wait_for(lambda: delayed_count(redis_client, keys) == 0, timeout=20)
    delivered = stream_task_ids(redis_client, keys)
    assert len(delivered) == total
    assert set(delivered) == ids


# ---------------------------------------------------- sleeping and restarts


def test_sleeping_promoter_wakes_for_an_earlier_task(
    redis_url: str, redis_client: redis.Redis, settings: Settings, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    publisher.publish("elsewhere", envelope(3600))  # the only due time it knows: an hour
    with running_promoter(redis_url, settings, max_idle_s=30) as promoter:
        channel = settings.keys.wakeup_channel
        wait_for(lambda: dict(redis_client.pubsub_numsub(channel)).get(channel.encode()) == 1)
        time.sleep(0.3)  # asleep now, for up to 30 s
        assert promoter.max_idle_s == 30

        task = envelope(0.5)  # a queue it has never seen
        assert publisher.publish(QUEUE, task) is None
        wait_for(lambda: stream_len(redis_client, keys) == 1, timeout=5, interval=0.005)
        lateness = time.time() - task.schedule_time.timestamp()
    assert -0.05 < lateness < 1.0, f"promoted {lateness:.3f}s after due"
    assert stream_task_ids(redis_client, keys) == [task.task_id]


def test_delayed_task_survives_a_redis_restart_without_ttl(
    private_redis: Any, settings: Settings, keys: QueueKeys,
) -> None:
    client = redis.Redis.from_url(private_redis.url)
    try:
        task = envelope(3)
        assert Publisher(client, settings).publish(QUEUE, task) is None
        for key in (keys.delayed, keys.delayed_data, settings.keys.queues):
            assert client.pttl(key) == -1, f"{key} has a TTL"

        private_redis.restart()
        assert delayed_count(client, keys) == 1
        assert client.pttl(keys.delayed) == -1

        with running_promoter(private_redis.url, settings):
            while time.time() < task.schedule_time.timestamp() - 0.05:
                assert stream_len(client, keys) == 0
                time.sleep(0.02)
            wait_for(lambda: stream_len(client, keys) == 1, timeout=5)
        assert stream_task_ids(client, keys) == [task.task_id]
        assert delayed_count(client, keys) == 0
    finally:
        client.close()


def test_promoter_keeps_working_after_a_redis_restart(
    private_redis: Any, settings: Settings, keys: QueueKeys,
) -> None:
    client = redis.Redis.from_url(private_redis.url)
    try:
        publisher = Publisher(client, settings)
        with running_promoter(private_redis.url, settings, max_idle_s=30) as promoter:
            before = envelope(0.2)
            publisher.publish(QUEUE, before)
            wait_for(lambda: stream_len(client, keys) == 1, timeout=5)

            private_redis.restart()
            restarted_at = time.monotonic()
            after = envelope(0.3)
            publisher.publish(QUEUE, after)
            wait_for(lambda: stream_len(client, keys) == 2, timeout=15,
                     message="no promotion after the restart")
            assert time.monotonic() - restarted_at < 10
            assert promoter._thread is not None and promoter._thread.is_alive()
        assert stream_task_ids(client, keys) == [before.task_id, after.task_id]
        assert redis_now_ms(client) >= after.due_ms()
    finally:
        client.close()


def test_registry_lost_with_a_redis_restart_is_rebuilt_by_the_next_publish(
    settings: Settings, keys: QueueKeys,
) -> None:
    """Without persistence a restart empties the registry; a running publisher refills it."""
    with PrivateRedisServer(appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        try:
            publisher = Publisher(client, settings)
            publisher.publish(QUEUE, envelope(3600))
            server.restart()
            assert client.exists(settings.keys.queues) == 0

            task = envelope(0.2)
            assert publisher.publish(QUEUE, task) is None
            assert client.smembers(settings.keys.queues) == {QUEUE.encode()}
            with running_promoter(server.url, settings):
                wait_for(lambda: stream_len(client, keys) == 1, timeout=5)
            assert stream_task_ids(client, keys) == [task.task_id]
        finally:
            client.close()


def test_invalid_queue_names_neither_get_registered_nor_stop_promoters(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, settings: Settings,
    keys: QueueKeys, publisher: Publisher,
) -> None:
    with pytest.raises(InvalidQueueName):
        publisher.publish_many([(QUEUE, envelope(60)), ("bad{name}", envelope(60))])
    assert keys_under(redis_client, key_prefix) == []

    # A bad name written by another client is skipped, not fatal to the promoter.
    redis_client.sadd(settings.keys.queues, "bad{name}")
    with running_promoter(redis_url, settings) as promoter:
        task = envelope(0.2)
        publisher.publish(QUEUE, task)
        wait_for(lambda: stream_len(redis_client, keys) == 1, timeout=5)
        assert promoter._thread is not None and promoter._thread.is_alive()
    assert stream_task_ids(redis_client, keys) == [task.task_id]


def test_schedule_time_is_stored_in_utc_milliseconds(
    redis_client: redis.Redis, keys: QueueKeys, publisher: Publisher,
) -> None:
    """A schedule_time with an offset is the same instant as its UTC form."""
    local = datetime.now(timezone(timedelta(hours=8))) + timedelta(hours=1)
    task = Envelope.new(task_type="sched.test", schedule_time=local)
    publisher.publish(QUEUE, task)
    score = redis_client.zscore(keys.delayed, task.task_id)
    assert score is not None and abs(score - local.timestamp() * 1000) < 1
