"""Commands across a broken connection or a stopped Redis (kombu_envelope.store.outages).

A lossy proxy in front of the session's Redis loses one reply on purpose: the
command was applied, its client never heard so, and tries again. Each repeated
step must have its effect once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import kombu
import pytest
import redis
from support.proxy import LossyProxy

from kombu_envelope.envelope import Envelope
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import RedisEndpoint, new_client
from kombu_envelope.store.idempotency import ClaimState, Idempotency
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.testing.redis_server import PrivateRedisServer

QUEUE = "orders"
ADAPTER = "kombu_envelope.kombu.adapter:MessageAdapter"


@pytest.fixture
def proxy(redis_url: str) -> Iterator[LossyProxy]:
    url = redis.connection.parse_url(redis_url)
    with LossyProxy(url.get("host", "127.0.0.1"), int(url.get("port", 6379))) as lossy:
        yield lossy


def client_through(url: str, settings: Settings) -> redis.Redis:
    """A client built as the transport builds its own (retries included)."""
    conninfo = kombu.Connection(url.replace("redis://", "envelope://"))
    client = new_client(RedisEndpoint.from_conninfo(conninfo), settings)
    client.ping()  # a Redis that answered once can have an outage
    return client


def envelope(task_id: str, **fields: object) -> Envelope:
    return Envelope.new(task_type="order.close", payload={"order_id": 1}, task_id=task_id,
                        **fields)


def test_a_publish_retried_after_its_reply_was_lost_is_stored_once(
    proxy: LossyProxy, redis_client: redis.Redis, key_prefix: str,
) -> None:
    settings = Settings(key_prefix=key_prefix)
    publisher = Publisher(client_through(proxy.url, settings), settings)
    stream = settings.keys.queue(QUEUE).stream(bucket_for(envelope("t").priority))

    proxy.drop_next_reply()
    entry_id = publisher.publish(QUEUE, envelope("t-1"))

    assert proxy.dropped == 1
    assert [entry for entry, _ in redis_client.xrange(stream)] == [entry_id.encode()]
    # A new publish of the same task_id (a retry, a deferral) is stored again.
    publisher.publish(QUEUE, envelope("t-1"))
    assert redis_client.xlen(stream) == 2


def test_a_delayed_publish_retried_after_its_reply_was_lost_is_stored_once(
    proxy: LossyProxy, redis_client: redis.Redis, key_prefix: str,
) -> None:
    settings = Settings(key_prefix=key_prefix)
    publisher = Publisher(client_through(proxy.url, settings), settings)
    keys = settings.keys.queue(QUEUE)
    later = envelope("t-2", schedule_time=_in_seconds(60))

    proxy.drop_next_reply()
    assert publisher.publish(QUEUE, later) is None

    assert proxy.dropped == 1
    assert redis_client.zrange(keys.delayed, 0, -1) == [b"t-2"]


def test_a_read_retried_after_its_reply_was_lost_delivers_what_it_took(
    proxy: LossyProxy, redis_client: redis.Redis, key_prefix: str,
) -> None:
    settings = Settings(key_prefix=key_prefix)
    # The plain transport and adapter: a message's body is its Envelope.
    with kombu.Connection(proxy.url.replace("redis://", "envelope://"),
                          transport="kombu_envelope.kombu.transport:Transport",
                          transport_options={"key_prefix": key_prefix,
                                             "message_adapter": ADAPTER}) as conn:
        channel = conn.default_channel
        kombu.Queue(QUEUE, channel=channel).declare()
        assert channel.basic_get(QUEUE) is None  # registers the consumer
        Publisher(redis_client, settings).publish(QUEUE, envelope("t-3"))

        proxy.drop_next_reply()
        message = channel.basic_get(QUEUE)

        assert proxy.dropped == 1
        assert message is not None, "the entry the lost read took was never delivered"
        assert b"t-3" in message.body
        message.ack()
        assert channel.basic_get(QUEUE) is None
    streams = settings.keys.queue(QUEUE).task_streams
    assert sum(redis_client.xlen(stream) for stream in streams) == 0


def test_a_done_marker_retried_after_its_reply_was_lost_counts_once(
    proxy: LossyProxy, key_prefix: str, caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(key_prefix=key_prefix)
    idempotency = Idempotency(client_through(proxy.url, settings), settings)
    claim = idempotency.claim("order.close", "o-7", "consumer-a t-7")
    assert claim.state is ClaimState.ACQUIRED

    proxy.drop_next_reply()
    with caplog.at_level(logging.WARNING, logger="kombu_envelope.store.idempotency"):
        assert idempotency.finish(claim, succeeded=True)

    assert proxy.dropped == 1
    assert "may have run twice" not in caplog.text
    again = idempotency.claim("order.close", "o-7", "consumer-b t-7b")
    assert again.state is ClaimState.DONE


def test_commands_wait_for_a_restarted_redis_then_fail_fast_past_the_tolerance(
    private_redis: PrivateRedisServer, key_prefix: str,
) -> None:
    settings = Settings(key_prefix=key_prefix, outage_tolerance_s=1.5)
    client = client_through(private_redis.url, settings)

    # A restart shorter than the tolerance is waited out.
    private_redis.kill()
    began = time.monotonic()
    restart = private_redis_restart_in(private_redis, 0.5)
    assert client.set("k", "v")
    assert time.monotonic() - began >= 0.4
    restart.join()

    # A longer outage: the first command waits the tolerance, the next ones fail at once.
    private_redis.kill()
    began = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert 1.4 <= time.monotonic() - began < 5
    began = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert time.monotonic() - began < 0.5

    private_redis.start()
    assert client.get("k") == b"v"  # from the AOF


def test_a_redis_that_never_answered_fails_at_once(key_prefix: str) -> None:
    with PrivateRedisServer() as server:
        url = server.url
    settings = Settings(key_prefix=key_prefix, outage_tolerance_s=30)
    conninfo = kombu.Connection(url.replace("redis://", "envelope://"))
    client = new_client(RedisEndpoint.from_conninfo(conninfo), settings)
    began = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert time.monotonic() - began < 2


def private_redis_restart_in(server: PrivateRedisServer, delay_s: float) -> threading.Timer:
    """Start ``server`` again ``delay_s`` seconds from now, from another thread (join it
    before touching the server again: a client may be served before the start returns)."""
    timer = threading.Timer(delay_s, server.start)
    timer.daemon = True
    timer.start()
    return timer


def _in_seconds(seconds: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()
