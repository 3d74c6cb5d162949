"""At-least-once delivery of the ``envelope://`` transport when consumers or Redis crash.

Consumers are real processes (``support.kombu_consumer``) that record in a
file every task they start and finish, so a test can tell which process ran
what, and how many times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from kombu import Queue
from support import wait_for
from support.envelope_streams import (
    connect,
    dead_letters,
    envelope_url,
    pending_count,
    stream_entries,
)
from support.kombu_consumer import ConsumerProcess

import kombu_envelope  # noqa: F401  (registers the envelope:// transport)
from kombu_envelope import Envelope
from kombu_envelope.keys import Bucket
from kombu_envelope.settings import Settings
from kombu_envelope.store.lease import reclaim_dead_consumers
from kombu_envelope.testing.redis_server import PrivateRedisServer

QUEUE = "work"


@pytest.fixture
def consumers(
    request: pytest.FixtureRequest, redis_url: str, key_prefix: str, tmp_path: Path
) -> Iterator[Callable[..., ConsumerProcess]]:
    """Starts consumer processes of ``QUEUE``; any still running are killed afterwards
    (their logs are printed when the test failed)."""
    started: list[ConsumerProcess] = []
    failed_before = request.session.testsfailed

    def start(name: str, *, lease_ms: int, url: str = redis_url, **kwargs: Any
              ) -> ConsumerProcess:
        process = ConsumerProcess(envelope_url(url), key_prefix, QUEUE, lease_ms=lease_ms,
                                  out=tmp_path / f"{name}.out", **kwargs)
        started.append(process)
        return process.__enter__()

    yield start
    failed = request.session.testsfailed > failed_before
    for process in started:
        if failed:
            process.__exit__(AssertionError, None, None)  # prints the log
        else:
            process.close()


def publish(url: str, key_prefix: str, count: int, **options: Any) -> list[str]:
    """Publish ``count`` Envelope tasks to ``QUEUE``; return their task_ids."""
    with connect(url, key_prefix, **options) as conn:
        producer = conn.Producer()
        ids = []
        for n in range(count):
            envelope = Envelope.new(task_type="jobs.run", payload={"n": n})
            producer.publish(envelope, serializer="envelope", routing_key=QUEUE,
                             declare=[Queue(QUEUE)])
            ids.append(envelope.task_id)
        return ids


def queue_is_empty(client: redis.Redis, settings: Settings) -> bool:
    """Nothing left in ``QUEUE``'s streams, nothing pending."""
    streams = settings.keys.queue(QUEUE).all_streams
    return (sum(client.xlen(s) for s in streams) == 0
            and sum(pending_count(client, s, settings.consumer_group) for s in streams) == 0)


def assert_never_within(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    """``predicate`` stays false for ``seconds`` (letting that time pass is the point)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not predicate(), what
        time.sleep(0.02)


def test_sigkilled_consumer_task_goes_to_another_consumer_only_after_the_lease(
    consumers: Callable[..., ConsumerProcess], redis_url: str, key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    lease_ms = 1500
    doomed = consumers("doomed", lease_ms=lease_ms, sleep_s=60)
    (task_id,) = publish(redis_url, key_prefix, 1)
    wait_for(lambda: doomed.started() == [task_id], message="the first consumer never started")
    survivor = consumers("survivor", lease_ms=lease_ms)

    doomed.kill()
    assert_never_within(survivor.started, 0.9,
                        "the task was taken over before the dead consumer's lease ran out")
    wait_for(lambda: survivor.done() == [task_id], timeout=15,
             message="the task never reached the surviving consumer")
    assert doomed.done() == []
    assert survivor.started() == [task_id]
    wait_for(lambda: queue_is_empty(redis_client, Settings(key_prefix=key_prefix)),
             message="the redelivered task was not acknowledged")


def test_task_longer_than_the_lease_on_a_live_consumer_runs_exactly_once(
    consumers: Callable[..., ConsumerProcess], redis_url: str, key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    lease_ms = 1000
    slow = consumers("slow", lease_ms=lease_ms, sleep_s=4)
    (task_id,) = publish(redis_url, key_prefix, 1)
    wait_for(lambda: slow.started() == [task_id], message="the slow consumer never started")
    idle = consumers("idle", lease_ms=lease_ms)  # watches for dead consumers the whole time

    wait_for(lambda: slow.done() == [task_id], timeout=15, message="the slow task never ended")
    wait_for(lambda: queue_is_empty(redis_client, Settings(key_prefix=key_prefix)),
             message="the slow task was not acknowledged")
    assert idle.started() == []
    assert slow.started() == [task_id]
    for process in (slow, idle):
        assert "took over" not in process.log_text()
        assert "no longer pending" not in process.log_text()
    assert dead_letters(redis_client, key_prefix, QUEUE) == []


def test_warm_shutdown_gives_back_prefetched_tasks_at_once(
    consumers: Callable[..., ConsumerProcess], redis_url: str, key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    lease_ms = 30_000
    settings = Settings(key_prefix=key_prefix)
    task_ids = publish(redis_url, key_prefix, 6)  # all waiting: the first reads take 6
    leaving = consumers("leaving", lease_ms=lease_ms, sleep_s=1.5, prefetch=6)
    normal = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    wait_for(lambda: leaving.started() and pending_count(
        redis_client, normal, settings.consumer_group) + len(leaving.done()) == 6,
        message="the consumer did not prefetch the 6 tasks")
    staying = consumers("staying", lease_ms=lease_ms)

    assert leaving.terminate() == 0  # finishes the running task, then closes its connection
    stopped_at = time.monotonic()
    ran_by_leaving = leaving.started()
    assert leaving.done() == ran_by_leaving  # the running task was finished, not abandoned
    given_back = sorted(set(task_ids) - set(ran_by_leaving))
    assert given_back, "the consumer ran every task before it was told to stop"
    wait_for(lambda: sorted(staying.done()) == given_back, timeout=10,
             message="the prefetched tasks were not given back")
    assert time.monotonic() - stopped_at < 5  # far less than the 30 s lease
    assert sorted(staying.started()) == given_back  # and none of them ran twice
    wait_for(lambda: queue_is_empty(redis_client, settings),
             message="the given-back tasks were not acknowledged")
    assert dead_letters(redis_client, key_prefix, QUEUE) == []


def test_consumer_survives_a_redis_restart_without_redelivering_acked_tasks(
    consumers: Callable[..., ConsumerProcess], private_redis: PrivateRedisServer,
    key_prefix: str,
) -> None:
    url = private_redis.url
    consumer = consumers("steady", lease_ms=3000, url=url)
    before = publish(url, key_prefix, 3)
    wait_for(lambda: consumer.done() == before, timeout=10,
             message="the tasks published before the restart were not consumed")

    private_redis.restart()
    # The blocking read is sent again on a new connection once Redis answers: the
    # consumer rides the restart out without reconnecting.
    consumer.wait_for_log("reading again on a new one", timeout=20)
    after = publish(url, key_prefix, 3)
    wait_for(lambda: consumer.done() == before + after, timeout=20,
             message="the tasks published after the restart were not consumed")

    with redis.Redis.from_url(url) as client:
        wait_for(lambda: queue_is_empty(client, Settings(key_prefix=key_prefix)),
                 message="the tasks published after the restart were not acknowledged")
    assert consumer.started() == before + after  # each ran once: no redelivery
    assert consumer.is_alive()


def test_connection_closed_while_redis_is_down_lets_another_consumer_take_its_task(
    consumers: Callable[..., ConsumerProcess], private_redis: PrivateRedisServer,
    key_prefix: str,
) -> None:
    url = private_redis.url
    lease_ms = 1000
    (task_id,) = publish(url, key_prefix, 1)
    holder = connect(url, key_prefix, lease_ms=lease_ms)
    # Not the default channel: the transport closes it, as it does Celery's remote-control one.
    channel = holder.channel()
    got: list[Any] = []
    consumer = kombu.Consumer(channel, [Queue(QUEUE)], accept=["envelope"],
                              callbacks=[lambda body, message: got.append(body)])
    consumer.consume()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            holder.drain_events(timeout=1)
    assert [body["task_id"] for body in got] == [task_id]

    private_redis.stop()
    holder.release()  # cannot reach Redis to give the task back; kombu ignores that
    private_redis.start()
    taker = consumers("taker", lease_ms=lease_ms, url=url)
    wait_for(lambda: taker.done() == [task_id], timeout=15,
             message="the closed connection's task was never taken over")


def test_task_whose_consumers_keep_dying_is_dead_lettered_after_max_redeliveries(
    redis_client: redis.Redis, redis_url: str, key_prefix: str,
) -> None:
    """Consumers that die holding the task are simulated by consumer names without a
    liveness key, whose read is made old enough (XCLAIM ... IDLE) to be taken back."""
    settings = Settings(key_prefix=key_prefix, lease_ms=1000, max_redeliveries=2)
    (task_id,) = publish(redis_url, key_prefix, 1)
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    ((_, original),) = stream_entries(redis_client, stream)

    for death in (1, 2):
        reply = redis_client.xreadgroup(settings.consumer_group, f"ghost-{death}",
                                        {stream: ">"}, count=1)
        assert reply, f"nothing for dead consumer #{death} to read"
        entry_id = reply[0][1][0][0]
        redis_client.xclaim(stream, settings.consumer_group, f"ghost-{death}", 0, [entry_id],
                            idle=10 * settings.lease_ms)
        assert reclaim_dead_consumers(redis_client, settings, QUEUE) == 1
        if death == 1:
            ((_, requeued),) = stream_entries(redis_client, stream)
            assert requeued == {**original, "n": b"1"}

    assert redis_client.xlen(stream) == 0
    assert pending_count(redis_client, stream, settings.consumer_group) == 0
    (dead,) = dead_letters(redis_client, key_prefix, QUEUE)
    assert dead["failure_class"] == b"redelivery_limit"
    assert dead["redeliveries"] == b"2"
    assert dead["queue"] == QUEUE.encode()
    assert dead["language"] == b"python"
    assert redis_client.sismember(f"{key_prefix}:dead-queues", QUEUE)
    for field, value in original.items():
        assert dead[f"raw.{field}"] == value
    assert Envelope.parse(dead["raw.body"]).task_id == task_id


def test_task_killing_every_consumer_that_runs_it_ends_in_the_dead_letter_stream(
    consumers: Callable[..., ConsumerProcess], redis_url: str, key_prefix: str,
    redis_client: redis.Redis,
) -> None:
    lease_ms = 1000
    options = {"max_redeliveries": 2}
    settings = Settings(key_prefix=key_prefix, lease_ms=lease_ms, max_redeliveries=2)
    first = consumers("first", lease_ms=lease_ms, sleep_s=60, options=options)
    (task_id,) = publish(redis_url, key_prefix, 1)
    wait_for(lambda: first.started() == [task_id], message="the first consumer never started")
    second = consumers("second", lease_ms=lease_ms, sleep_s=60, options=options)

    first.kill()
    wait_for(lambda: second.started() == [task_id], timeout=15,
             message="the task never reached the second consumer")
    second.kill()  # the second death: the next takeover dead-letters the task
    wait_for(lambda: reclaim_dead_consumers(redis_client, settings, QUEUE), timeout=15,
             message="the second dead consumer's task was never taken back")

    (dead,) = dead_letters(redis_client, key_prefix, QUEUE)
    assert dead["failure_class"] == b"redelivery_limit"
    assert dead["redeliveries"] == b"2"
    assert Envelope.parse(dead["raw.body"]).task_id == task_id
    assert queue_is_empty(redis_client, settings)
