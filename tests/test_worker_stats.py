"""Worker statistics (docs/protocol.md, section 17): the pure helpers, and the buffer and
reader against the real Redis."""

from __future__ import annotations

import pytest
import redis

from kombu_envelope import Settings
from kombu_envelope.store import worker_stats
from kombu_envelope.store.announcements import Announcements, WorkerAnnouncement
from kombu_envelope.store.worker_stats import (
    BOUNDS,
    STATS_TTL_MS,
    StatsBuffer,
    field_name,
    observation,
    parse_stats,
    read_stats,
    wait_seconds,
)


def test_bounds_are_the_sections_and_a_hash_holds_41_fields_per_type() -> None:
    assert BOUNDS == ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5",
                      "5", "10", "30", "60", "300", "900", "3600", "inf")
    assert 5 + 2 * (len(BOUNDS) + 1) == 41


@pytest.mark.parametrize(("seconds", "bucket", "sum_us"), [
    (0, "0.005", 0), (0.005, "0.005", 5000), (0.0051, "0.01", 5100), (1, "1", 1_000_000),
    (2.4999996, "2.5", 2_500_000), (3600.5, "inf", 3_600_500_000), (-3, "0.005", 0)])
def test_an_observation_adds_one_to_its_first_bucket_and_microseconds_to_the_sum(
        seconds: float, bucket: str, sum_us: int) -> None:
    assert observation("run", seconds) == {f"run_le_{bucket}": 1, "run_sum_us": sum_us}


def test_a_wait_counts_from_when_the_task_was_due_and_never_below_zero() -> None:
    assert wait_seconds(started_ms=10_250, due_ms=10_000) == 0.25
    assert wait_seconds(started_ms=9_000, due_ms=10_000) == 0


def test_parse_stats_sums_buckets_cumulatively_and_leaves_out_foreign_fields() -> None:
    parsed = parse_stats({
        b"bill.charge go succeeded": b"3", "bill.charge go failed": "1",
        "bill.charge go run_le_0.005": "1", "bill.charge go run_le_1": "2",
        "bill.charge go run_le_inf": "1", "bill.charge go run_sum_us": "2500000",
        "- python dead": "2", "not-a-field": "1", "bill.charge go succeeded x": "nan"})
    assert [(s.task_type, s.language) for s in parsed] == [("-", "python"), ("bill.charge", "go")]
    undecoded, charge = parsed
    assert undecoded.counters == {"succeeded": 0, "failed": 0, "retried": 0, "dead": 2,
                                  "duplicate": 0}
    assert charge.counters["succeeded"] == 3 and charge.counters["failed"] == 1
    run = charge.histograms["run"]
    assert dict(run.buckets)["0.005"] == 1 and dict(run.buckets)["0.5"] == 1
    assert dict(run.buckets)["1"] == 3 and dict(run.buckets)["inf"] == 4
    assert (run.count, run.sum_s) == (4, 2.5)
    assert charge.histograms["wait"].count == 0


def test_the_buffer_sums_per_field_and_flushes_one_multi_per_queue(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    buffer = StatsBuffer(settings)
    for _ in range(3):
        buffer.count("billing", "bill.charge", "succeeded")
        buffer.add("billing", "bill.charge", observation("run", 0.2))
    buffer.count("mail", "mail.send", "dead")
    assert buffer.flush(redis_client) and buffer.queues() == []
    key = settings.keys.queue("billing").stats
    assert redis_client.hgetall(key) == {
        field_name("bill.charge", "succeeded").encode(): b"3",
        field_name("bill.charge", "run_le_0.25").encode(): b"3",
        field_name("bill.charge", "run_sum_us").encode(): b"600000"}
    assert 0 < redis_client.pttl(key) <= STATS_TTL_MS
    mail, = read_stats(redis_client, settings, "mail")
    assert (mail.task_type, mail.language, mail.counters["dead"]) == ("mail.send", "python", 1)


def test_a_failed_flush_keeps_its_increments_for_the_next(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    buffer = StatsBuffer(settings)
    buffer.count("billing", "bill.charge", "failed")
    unreachable = redis.Redis(port=1, socket_connect_timeout=0.2)
    assert buffer.flush(unreachable) is False
    buffer.count("billing", "bill.charge", "failed")
    assert buffer.flush(redis_client)
    stats, = read_stats(redis_client, settings, "billing")
    assert stats.counters["failed"] == 2


def test_a_multi_the_attempt_sends_carries_the_increments(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix)
    buffer = StatsBuffer(settings)
    buffer.count("billing", "bill.charge", "duplicate")
    pipe = redis_client.pipeline(transaction=True)
    pipe.set(f"{key_prefix}:{{billing}}:other", 1)
    taken = buffer.add_to(pipe, "billing")
    pipe.execute()
    assert taken == {field_name("bill.charge", "duplicate"): 1} and buffer.queues() == []
    assert read_stats(redis_client, settings, "billing")[0].counters["duplicate"] == 1


def test_counts_ride_on_an_attempts_multi_at_most_once_a_second_per_queue(
        redis_client: redis.Redis, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(key_prefix=key_prefix)
    buffer = StatsBuffer(settings)

    def ride(queue: str) -> dict[str, int]:
        buffer.count(queue, "bill.charge", "succeeded")
        pipe = redis_client.pipeline(transaction=True)
        pipe.set(f"{key_prefix}:{{{queue}}}:other", 1)
        taken = buffer.ride(pipe, queue)
        pipe.execute()
        return taken

    def succeeded(queue: str) -> int:
        return read_stats(redis_client, settings, queue)[0].counters["succeeded"]

    assert ride("billing") and succeeded("billing") == 1  # the first rides at once
    assert ride("billing") == {} and buffer.queues() == ["billing"]  # kept for later
    assert succeeded("billing") == 1
    assert ride("refunds")  # another queue's counts ride on their own clock
    monkeypatch.setattr(worker_stats, "RIDE_EVERY_S", 0.0)  # as a second later
    assert ride("billing") == {field_name("bill.charge", "succeeded"): 2}
    assert succeeded("billing") == 3 and buffer.queues() == []


def test_python_announcements_carry_the_renewal_period(
        redis_client: redis.Redis, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix, lease_ms=1500)
    announcements = Announcements(redis_client, settings)
    announcements.announce(WorkerAnnouncement.of_this_process("c-1", ["billing"]))
    worker, = announcements.workers("billing")
    assert worker.heartbeat_ms == 500
    assert b'"heartbeat_ms":500' in redis_client.get(settings.keys.worker("c-1"))
