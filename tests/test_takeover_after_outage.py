"""Takeovers after Redis was away (docs/protocol.md, sections 5 and 9).

Redis counts a key's expiry in wall-clock time, so an outage longer than what is
left of a lease expires every liveness key at once. When Redis answers again, live
consumers set theirs within one renewal interval; nobody may take their entries or
idempotency claims over before that.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from kombu_envelope.keys import Bucket
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import client_for_url
from kombu_envelope.store.idempotency import ClaimState, Idempotency
from kombu_envelope.store.lease import LeaseKeeper
from kombu_envelope.testing.redis_server import PrivateRedisServer

QUEUE = "takeover"
LEASE_MS = 1500
INTERVAL_S = LEASE_MS / 3000

pytestmark = pytest.mark.timeout(60)


def _owner(client: redis.Redis, stream: str, group: str) -> str | None:
    pending = client.xpending_range(stream, group, min="-", max="+", count=10)
    return pending[0]["consumer"].decode() if pending else None


def test_a_keeper_whose_renewal_waited_through_an_outage_takes_nothing_over(
    private_redis: PrivateRedisServer, key_prefix: str,
) -> None:
    """Consumer ``holder`` is alive but renews 0.4 s after Redis is back (a renewal lands
    when it lands); keeper ``taker``'s own renewal waited through the outage, so it must
    not judge ``holder`` dead until it has renewed twice at once. Once ``holder`` really
    stops renewing, its entry is taken over."""
    settings = Settings(key_prefix=key_prefix, lease_ms=LEASE_MS)
    client = redis.Redis.from_url(private_redis.url)
    stream = settings.keys.queue(QUEUE).stream(Bucket.NORMAL)
    group = settings.consumer_group
    client.xgroup_create(stream, group, id="0", mkstream=True)
    client.xadd(stream, {"body": "{}"})
    assert client.xreadgroup(group, "holder", {stream: ">"}, count=1)
    holder_key = settings.keys.consumer("holder")
    client.set(holder_key, "test", px=LEASE_MS)

    taker = LeaseKeeper(lambda: client_for_url(private_redis.url, settings), settings)
    taker.register("taker", [QUEUE])
    try:
        time.sleep(3 * INTERVAL_S)  # the keeper has renewed twice in a row
        private_redis.kill()
        time.sleep(LEASE_MS / 1000 + 0.5)  # longer than the lease: every key expires
        private_redis.start()
        client = redis.Redis.from_url(private_redis.url)
        assert not client.exists(holder_key)
        time.sleep(0.4)  # within one renewal interval of Redis answering again
        client.set(holder_key, "test", px=LEASE_MS)
        time.sleep(3 * INTERVAL_S)  # the keeper has taken stock at least once

        assert _owner(client, stream, group) == "holder"

        client.delete(holder_key)  # now the holder is gone for good
        deadline = time.monotonic() + 10
        while _owner(client, stream, group) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _owner(client, stream, group) is None
        assert client.xlen(stream) == 1  # put back for another reader, not lost
        ((_, fields),) = client.xrange(stream)
        assert fields[b"n"] == b"1"
    finally:
        taker.unregister("taker")
        taker.stop()


@pytest.fixture
def idempotency(redis_url: str, key_prefix: str) -> Idempotency:
    settings = Settings(key_prefix=key_prefix, lease_ms=LEASE_MS)
    return Idempotency(client_for_url(redis_url, settings), settings)


def test_a_claim_whose_holder_renews_within_one_interval_is_not_taken_over(
    idempotency: Idempotency, redis_client: redis.Redis,
) -> None:
    first = idempotency.claim("t", "k1", "dead-or-slow task-1")
    assert first.state is ClaimState.ACQUIRED
    holder_key = idempotency.settings.keys.consumer("dead-or-slow")
    renewal = threading.Timer(INTERVAL_S / 3,
                              lambda: redis_client.set(holder_key, "test", px=LEASE_MS))
    renewal.start()
    began = time.monotonic()
    second = idempotency.claim("t", "k1", "other task-1")
    renewal.join()

    assert second.state is ClaimState.BUSY
    assert second.other == "dead-or-slow task-1"
    assert time.monotonic() - began >= INTERVAL_S  # it looked a second time


def test_a_claim_whose_holder_stays_gone_is_taken_over(
    idempotency: Idempotency,
) -> None:
    assert idempotency.claim("t", "k2", "gone task-2").state is ClaimState.ACQUIRED

    second = idempotency.claim("t", "k2", "other task-2")

    assert second.state is ClaimState.ACQUIRED
    assert second.taken_over == "gone task-2"
