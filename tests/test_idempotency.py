"""Idempotency claims in Redis, and keys derived when Celery tasks are published."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from apps.reliable_app import create_app
from celery import Celery
from support.envelope_streams import envelope_url

from celery_ext.idempotency import key_from_payload
from kombu_envelope.codec import decode_entry
from kombu_envelope.keys import Bucket, KeySpace
from kombu_envelope.settings import Settings
from kombu_envelope.store.idempotency import DEFAULT_CLAIM_MS, ClaimState, Idempotency

LEASE_MS = 5000


@pytest.fixture
def idem(redis_client: redis.Redis, key_prefix: str) -> Idempotency:
    return Idempotency(redis_client, Settings(key_prefix=key_prefix, lease_ms=LEASE_MS),
                       done_ttl_s=60)


def alive(client: redis.Redis, prefix: str, consumer: str) -> None:
    client.set(KeySpace(prefix).consumer(consumer), "host 1 python", px=LEASE_MS)


def test_a_done_key_makes_later_tasks_duplicates(idem: Idempotency,
                                                 redis_client: redis.Redis) -> None:
    claim = idem.claim("order.close", "o-1", Idempotency.holder("c1", "t1"))
    assert claim.state is ClaimState.ACQUIRED
    assert idem.finish(claim, succeeded=True)
    again = idem.claim("order.close", "o-1", Idempotency.holder("c2", "t2"))
    assert again.state is ClaimState.DONE
    assert again.other is not None and again.other.startswith("done t1 ")
    assert 55_000 < redis_client.pttl(claim.key) <= 60_000  # done_ttl_s


def test_a_failure_releases_the_key_for_a_retry(idem: Idempotency) -> None:
    claim = idem.claim("order.close", "o-2", "c1 t1")
    assert idem.finish(claim, succeeded=False)
    assert idem.claim("order.close", "o-2", "c1 t1").state is ClaimState.ACQUIRED


def test_a_live_holder_keeps_the_key(idem: Idempotency, redis_client: redis.Redis,
                                     key_prefix: str) -> None:
    alive(redis_client, key_prefix, "c1")
    assert idem.claim("order.close", "o-3", "c1 t1").state is ClaimState.ACQUIRED
    busy = idem.claim("order.close", "o-3", "c2 t2")
    assert (busy.state, busy.other) == (ClaimState.BUSY, "c1 t1")
    # The same holder (a redelivery to the same consumer) may go on.
    assert idem.claim("order.close", "o-3", "c1 t1").state is ClaimState.ACQUIRED


def test_the_key_of_a_dead_holder_is_taken_over(idem: Idempotency,
                                                caplog: pytest.LogCaptureFixture) -> None:
    first = idem.claim("order.close", "o-4", "dead t1")  # no liveness key: dead
    taken = idem.claim("order.close", "o-4", "c2 t2")
    assert (taken.state, taken.taken_over) == (ClaimState.ACQUIRED, "dead t1")
    with caplog.at_level(logging.WARNING, logger="kombu_envelope.store.idempotency"):
        assert not idem.finish(first, succeeded=True)  # too late: it was taken over
    assert "may have run twice" in caplog.text
    assert idem.finish(taken, succeeded=True)


def test_only_one_of_two_takers_wins(idem: Idempotency) -> None:
    idem.claim("order.close", "o-5", "dead t1")
    first = idem.begin("order.close", "o-5", "c2 t2", replace="dead t1")
    second = idem.begin("order.close", "o-5", "c3 t3", replace="dead t1")
    assert (first.state, second.state, second.other) == (
        ClaimState.ACQUIRED, ClaimState.BUSY, "c2 t2")


def test_a_claim_lasts_the_timeout_plus_the_lease(idem: Idempotency,
                                                  redis_client: redis.Redis) -> None:
    assert idem.claim_ms(2000) == 2000 + LEASE_MS
    assert idem.claim_ms(None) == DEFAULT_CLAIM_MS
    claim = idem.claim("order.close", "o-6", "c1 t1", timeout_ms=2000)
    assert 6000 < redis_client.pttl(claim.key) <= 7000
    claim = idem.claim("order.close", "o-7", "c1 t1")
    assert DEFAULT_CLAIM_MS - 1000 < redis_client.pttl(claim.key) <= DEFAULT_CLAIM_MS


# ----------------------------------------------------------- keys at publish


def test_keys_from_payload_fields() -> None:
    assert key_from_payload({"order_id": "202509110001"}, ["order_id"]) == "202509110001"
    assert key_from_payload({"shop": 7, "order": {"b": 1, "a": 2}, "x": 1},
                            ["shop", "order"]) == '7:{"a":2,"b":1}'
    with pytest.raises(KeyError):
        key_from_payload({}, ["order_id"])


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, LEASE_MS)
    yield app
    app.close()


def stored_keys(client: redis.Redis, prefix: str) -> list[str | None]:
    stream = KeySpace(prefix).queue("parked").stream(Bucket.NORMAL)
    return [decode_entry(fields).idempotency_key for _, fields in client.xrange(stream)]


def test_the_key_is_derived_at_publish(app: Celery, redis_client: redis.Redis,
                                       key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    effect = app.tasks["reliable.effect"]  # idempotency_fields=("order_id",)
    effect.apply_async(("o-8",), queue="parked")
    effect.apply_async(kwargs={"order_id": "o-9", "hold": False}, queue="parked")
    effect.apply_async(("o-10",), headers={"idempotency_key": "explicit"}, queue="parked")
    app.tasks["reliable.versioned"].apply_async((1,), queue="parked")  # no option: no key
    with caplog.at_level(logging.WARNING, logger="celery_ext.idempotency"):
        app.send_task("reliable.effect", kwargs={"hold": True}, queue="parked")
    assert "payload field 'order_id' missing" in caplog.text
    assert stored_keys(redis_client, key_prefix) == ["o-8", "o-9", "explicit", None, None]
