"""Publisher.publish_iter: Envelopes drawn one at a time, stored while the rest are built."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from support.connection_loss import connection_lost_after_flushes

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import PRIORITY_DEFAULT, Envelope, utcnow
from kombu_envelope.errors import InvalidEnvelope
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store import replication
from kombu_envelope.store.publisher import FLUSH_EVERY, ITER_CHUNK, Publisher
from kombu_envelope.testing.redis_server import PrivateRedisServer

QUEUE = "q"


def stored(client: redis.Redis, settings: Settings, queue: str = QUEUE) -> list[Envelope]:
    stream = settings.keys.queue(queue).stream(bucket_for(PRIORITY_DEFAULT))
    return [decode_entry(fields) for _, fields in client.xrange(stream)]


def numbered(count: int, drawn: list[int] | None = None) -> Iterator[tuple[str, Envelope]]:
    """``count`` Envelopes with payload ``{"n": n}``, built as drawn (noted in ``drawn``)."""
    for n in range(count):
        if drawn is not None:
            drawn.append(n)
        yield QUEUE, Envelope.new(task_type="order.close", payload={"n": n})


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


def test_many_chunks_are_stored_once_each_in_the_order_drawn(
        redis_client: redis.Redis, settings: Settings) -> None:
    count = ITER_CHUNK * 2 + FLUSH_EVERY + 7
    ids = Publisher(redis_client, settings).publish_iter(numbered(count))
    entries = redis_client.xrange(settings.keys.queue(QUEUE).stream(bucket_for(PRIORITY_DEFAULT)))
    assert [entry_id.decode() for entry_id, _ in entries] == ids
    assert [decode_entry(fields).payload["n"] for _, fields in entries] == list(range(count))
    last = decode_entry(entries[-1][1])
    assert redis_client.hget(settings.keys.queue(QUEUE).task_record(last.task_id),
                             "state") == b"queued"


def test_redis_stores_the_first_chunk_while_the_next_is_drawn(
        redis_client: redis.Redis, settings: Settings) -> None:
    seen: list[int] = []

    def watched() -> Iterator[tuple[str, Envelope]]:
        for n, item in enumerate(numbered(ITER_CHUNK + FLUSH_EVERY + 1)):
            if n == ITER_CHUNK + FLUSH_EVERY:  # the first chunk's replies were read by now
                seen.append(len(stored(redis_client, settings)) >= ITER_CHUNK)
            yield item

    Publisher(redis_client, settings).publish_iter(watched())
    assert seen == [True]


def test_nothing_drawn_nothing_sent(redis_client: redis.Redis, settings: Settings) -> None:
    assert Publisher(redis_client, settings).publish_iter(iter(())) == []


def test_an_invalid_envelope_raises_naming_it_once_the_ones_before_are_stored(
        redis_client: redis.Redis, settings: Settings) -> None:
    bad_at = ITER_CHUNK + 234
    drawn: list[int] = []

    def with_one_too_far_ahead() -> Iterator[tuple[str, Envelope]]:
        for n, item in enumerate(numbered(bad_at + 500, drawn)):
            if n == bad_at:
                item = (QUEUE, Envelope.new(task_type="order.close",
                                            schedule_time=utcnow() + timedelta(days=3650)))
            yield item

    with pytest.raises(InvalidEnvelope) as refused:
        Publisher(redis_client, settings).publish_iter(with_one_too_far_ahead())
    assert [(v.field, v.rule) for v in refused.value.violations] == [
        ("schedule_time", "max_delay")]
    assert [e.payload["n"] for e in stored(redis_client, settings)] == list(range(bad_at))
    assert drawn[-1] == bad_at  # nothing after it was drawn
    assert redis_client.zcard(settings.keys.queue(QUEUE).delayed) == 0


def test_an_error_of_the_iterable_propagates_once_what_it_made_is_stored(
        redis_client: redis.Redis, settings: Settings) -> None:
    def failing() -> Iterator[tuple[str, Envelope]]:
        yield from numbered(FLUSH_EVERY + 50)
        raise RuntimeError("the rows ran out")

    with pytest.raises(RuntimeError, match="the rows ran out"):
        Publisher(redis_client, settings).publish_iter(failing())
    assert len(stored(redis_client, settings)) == FLUSH_EVERY + 50


def test_delayed_and_keyed_envelopes_register_their_queue_and_keep_their_order(
        redis_client: redis.Redis, settings: Settings) -> None:
    later = utcnow() + timedelta(hours=1)
    items = [(QUEUE, Envelope.new(task_type="order.step", ordering_key="A", payload={"n": n}))
             for n in range(3)]
    items += [("later", Envelope.new(task_type="order.close", schedule_time=later))
              for _ in range(FLUSH_EVERY + 1)]
    ids = Publisher(redis_client, settings).publish_iter(iter(items))
    assert ids[1:3] == ["waiting", "waiting"]  # behind the key's head, in order
    assert ids[3:] == [None] * (FLUSH_EVERY + 1)
    assert [e.payload["n"] for e in stored(redis_client, settings)] == [0]
    assert redis_client.smembers(settings.keys.queues) == {QUEUE.encode(), b"later"}
    assert redis_client.zcard(settings.keys.queue("later").delayed) == FLUSH_EVERY + 1
    order = settings.keys.queue(QUEUE).base + ":order:A"
    assert redis_client.lrange(order, 0, -1) == [e.task_id.encode() for _, e in items[:3]]


def test_a_failed_step_is_raised_after_its_chunk_and_nothing_more_is_drawn(
        redis_client: redis.Redis, settings: Settings) -> None:
    broken = settings.keys.queue("broken").stream(bucket_for(PRIORITY_DEFAULT))
    redis_client.set(broken, "not a stream")
    drawn: list[int] = []

    def one_broken() -> Iterator[tuple[str, Envelope]]:
        for n, item in enumerate(numbered(ITER_CHUNK * 3, drawn)):
            yield ("broken", item[1]) if n == 10 else item

    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        Publisher(redis_client, settings).publish_iter(one_broken())
    # The first chunk's replies are read while the second is drawn: there it stops.
    assert drawn[-1] == ITER_CHUNK + FLUSH_EVERY - 1
    assert len(stored(redis_client, settings)) == ITER_CHUNK + FLUSH_EVERY - 1


def test_a_connection_lost_mid_stream_has_each_envelope_stored_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with PrivateRedisServer() as server:
        client = redis.Redis.from_url(server.url)
        # In the first chunk, then in the second.
        with connection_lost_after_flushes(monkeypatch, server.url, 3, 14) as killed:
            ids = Publisher(client).publish_iter(numbered(ITER_CHUNK * 2 + 3))
        assert killed == [1, 1]
        entries = client.xrange(Settings().keys.queue(QUEUE).stream(bucket_for(PRIORITY_DEFAULT)))
        assert [entry_id.decode() for entry_id, _ in entries] == ids  # repeats stored nothing
        assert [decode_entry(fields).payload["n"] for _, fields in entries] == list(
            range(ITER_CHUNK * 2 + 3))
        client.close()


def test_with_wait_replicas_each_chunk_ends_with_its_wait(redis_client: redis.Redis,
                                                          key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix, wait_replicas=1, wait_timeout_ms=10)
    before = replication.short_waits()  # the test Redis has no replica: every WAIT is short
    ids = Publisher(redis_client, settings).publish_iter(numbered(ITER_CHUNK + 1))
    assert replication.short_waits() - before == 2
    assert len(ids) == len(stored(redis_client, settings)) == ITER_CHUNK + 1
