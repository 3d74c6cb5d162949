"""kombu's usual behaviours on the ``envelope://`` transport, against a real Redis.

The behaviour class :class:`EnvelopeTransportBehaviour` holds the tests; each
``Test...`` subclass runs all of them under one set of transport options
(the layout of kombu's own ``t/integration/common.py``).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import timedelta
from typing import Any, ClassVar

import kombu
import pytest
import redis
from kombu import Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub
from kombu.exceptions import ChannelError, OperationalError
from support import wait_for
from support.envelope_streams import (
    connect,
    dead_letters,
    drain_until,
    envelope_url,
    pending_count,
    stream_entries,
)

import kombu_envelope  # noqa: F401  (registers the envelope:// transport)
from kombu_envelope import Envelope, InvalidEnvelope
from kombu_envelope.codec import decode_entry, encode_entry
from kombu_envelope.envelope import utcnow
from kombu_envelope.keys import KeySpace, QueueKeys, bucket_for
from kombu_envelope.kombu import settle
from kombu_envelope.settings import Settings
from kombu_envelope.store.promoter import Promoter

#: How long a "nothing else arrives" check waits (seconds).
QUIET_S = 0.5


class Collector:
    """Consumer callback that records every message, acking it or not."""

    def __init__(self, ack: bool = True) -> None:
        self.ack = ack
        self.messages: list[Any] = []

    def __call__(self, body: Any, message: Any) -> None:
        self.messages.append(message)
        if self.ack:
            message.ack()

    @property
    def bodies(self) -> list[Any]:
        return [m.decode() for m in self.messages]

    def __len__(self) -> int:
        return len(self.messages)


def assert_nothing_delivered(conn: kombu.Connection, seconds: float = QUIET_S) -> None:
    """``drain_events`` delivers nothing for ``seconds`` (the wait is the point)."""
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=seconds)


def total_length(client: redis.Redis, streams: tuple[str, ...]) -> int:
    return sum(client.xlen(s) for s in streams)


def fields_key(fields: dict[str, bytes]) -> bytes:
    """What tells apart the entries of one test: the body of a task or of a kombu message."""
    return fields.get("body") or fields.get("kombu") or b""


def task_stream(queue_keys: QueueKeys, priority: int) -> str:
    """The task stream an Envelope of ``priority`` goes to."""
    return queue_keys.stream(bucket_for(priority))


def task(priority: int = 100, **fields: Any) -> Envelope:
    return Envelope.new(task_type="orders.close", payload={"order_id": 7}, priority=priority,
                        **fields)


class EnvelopeTransportBehaviour:
    """The behaviours every configuration of the transport must show."""

    #: Transport options of this configuration (besides ``key_prefix``).
    options: ClassVar[dict[str, Any]] = {}

    # ------------------------------------------------------------ fixtures

    @pytest.fixture
    def settings(self, key_prefix: str) -> Settings:
        return Settings.from_transport_options({"key_prefix": key_prefix, **self.options})

    @pytest.fixture
    def keys(self, settings: Settings) -> KeySpace:
        return settings.keys

    @pytest.fixture
    def open_connection(
        self, redis_url: str, key_prefix: str
    ) -> Iterator[Callable[..., kombu.Connection]]:
        """Opens Connections of this configuration; all are released after the test."""
        opened: list[kombu.Connection] = []

        def open_one(**overrides: Any) -> kombu.Connection:
            conn = connect(redis_url, key_prefix, **{"lease_ms": 10_000, **self.options,
                                                     **overrides})
            opened.append(conn)
            return conn

        yield open_one
        for conn in opened:
            conn.release()

    @pytest.fixture
    def connection(self, open_connection: Callable[..., kombu.Connection]) -> kombu.Connection:
        return open_connection()

    # ----------------------------------------------------------- exchanges

    def test_direct_exchange_routes_by_exact_routing_key(
        self, connection: kombu.Connection, keys: KeySpace, redis_client: redis.Redis
    ) -> None:
        exchange = Exchange("shop", "direct")
        orders = Queue("orders", exchange, routing_key="orders")
        payments = Queue("payments", exchange, routing_key="payments")
        producer = connection.Producer(exchange=exchange)
        producer.declare()
        for queue in (orders, payments):
            queue(connection.default_channel).declare()
        producer.publish({"to": "orders"}, routing_key="orders")
        producer.publish({"to": "payments"}, routing_key="payments")
        producer.publish({"to": "nobody"}, routing_key="refunds")

        got_orders, got_payments = Collector(), Collector()
        with connection.Consumer([orders], callbacks=[got_orders]), \
                connection.Consumer([payments], callbacks=[got_payments]):
            drain_until(connection, lambda: len(got_orders) + len(got_payments) >= 2)
            assert_nothing_delivered(connection)

        assert got_orders.bodies == [{"to": "orders"}]
        assert got_payments.bodies == [{"to": "payments"}]
        assert got_orders.messages[0].delivery_info["routing_key"] == "orders"
        assert got_orders.messages[0].content_type == "application/json"
        for name in ("orders", "payments"):
            assert total_length(redis_client, keys.queue(name).all_streams) == 0

    def test_topic_exchange_routes_wildcard_patterns(
        self, connection: kombu.Connection
    ) -> None:
        exchange = Exchange("events", "topic")
        order_events = Queue("order-events", exchange, routing_key="orders.*")
        errors = Queue("errors", exchange, routing_key="#.error")
        producer = connection.Producer(exchange=exchange)
        producer.declare()
        for queue in (order_events, errors):
            queue(connection.default_channel).declare()
        for routing_key in ("orders.created", "payments.card.error", "orders.error",
                            "orders.created.late", "misc.info"):
            producer.publish({"rk": routing_key}, routing_key=routing_key)

        got_orders, got_errors = Collector(), Collector()
        with connection.Consumer([order_events], callbacks=[got_orders]), \
                connection.Consumer([errors], callbacks=[got_errors]):
            drain_until(connection, lambda: len(got_orders) + len(got_errors) >= 4)
            assert_nothing_delivered(connection)

        assert sorted(b["rk"] for b in got_orders.bodies) == ["orders.created", "orders.error"]
        assert sorted(b["rk"] for b in got_errors.bodies) == ["orders.error",
                                                              "payments.card.error"]

    def test_fanout_exchange_delivers_a_copy_to_every_bound_queue(
        self, connection: kombu.Connection, keys: KeySpace, redis_client: redis.Redis
    ) -> None:
        exchange = Exchange("broadcast", "fanout")
        first = Queue("fan-1", exchange)
        second = Queue("fan-2", exchange)
        producer = connection.Producer(exchange=exchange)
        producer.publish({"n": 1}, declare=[first, second])
        producer.publish(task(), serializer="envelope", declare=[first, second])

        got_first, got_second = Collector(), Collector()
        with connection.Consumer([first], callbacks=[got_first]), \
                connection.Consumer([second], callbacks=[got_second]):
            drain_until(connection, lambda: len(got_first) == 2 and len(got_second) == 2)

        for got in (got_first, got_second):
            assert got.bodies[1] == {"n": 1}  # the task stream is served first
            assert got.bodies[0]["task_type"] == "orders.close"
        for name in ("fan-1", "fan-2"):
            assert total_length(redis_client, keys.queue(name).all_streams) == 0

    @pytest.mark.parametrize("kind", ["direct", "fanout", "topic"])
    def test_bindings_declared_in_one_connection_route_publishes_of_another(
        self, open_connection: Callable[..., kombu.Connection], kind: str
    ) -> None:
        exchange = Exchange(f"shared-{kind}", kind)
        queue = Queue(f"bound-{kind}", exchange,
                      routing_key={"direct": "jobs.new", "fanout": "", "topic": "jobs.*"}[kind])
        consumer_conn = open_connection()
        publisher_conn = open_connection()
        queue(consumer_conn.default_channel).declare()  # binds in consumer_conn only

        producer = publisher_conn.Producer(exchange=exchange)  # declares the exchange only
        producer.publish({"from": "publisher"}, routing_key="jobs.new")
        producer.publish(task(), serializer="envelope", routing_key="jobs.new")

        got = Collector()
        with consumer_conn.Consumer([queue], callbacks=[got]):
            drain_until(consumer_conn, lambda: len(got) == 2)
        assert {"from": "publisher"} in got.bodies
        assert any(isinstance(b, dict) and b.get("task_type") == "orders.close"
                   for b in got.bodies)

    # --------------------------------------------------------- SimpleQueue

    def test_simple_queue_put_get_qsize_and_clear(self, connection: kombu.Connection) -> None:
        with closing(connection.SimpleQueue("simple")) as queue:
            for n in range(3):
                queue.put({"n": n})
            assert queue.qsize() == 3
            assert len(queue) == 3

            first = queue.get_nowait()
            assert first.payload == {"n": 0}
            first.ack()
            assert queue.qsize() == 2

            assert queue.clear() == 2
            assert queue.qsize() == 0
            with pytest.raises(queue.Empty):
                queue.get_nowait()

            queue.put({"Hello": "World"}, headers={"k1": "v1"})
            message = queue.get(timeout=5)
            assert message.payload == {"Hello": "World"}
            assert message.content_type == "application/json"
            assert message.content_encoding == "utf-8"
            assert message.headers == {"k1": "v1"}
            message.ack()
            assert queue.qsize() == 0
            with pytest.raises(queue.Empty):
                queue.get(timeout=QUIET_S)

    def test_queue_size_from_passive_declare_counts_only_waiting_messages(
        self, connection: kombu.Connection
    ) -> None:
        channel = connection.default_channel
        with pytest.raises(ChannelError):
            channel.queue_declare(queue="sized", passive=True)
        queue = Queue("sized")
        producer = connection.Producer()
        producer.publish({"plain": 1}, routing_key="sized", declare=[queue])
        producer.publish(task(priority=250), serializer="envelope", routing_key="sized")
        producer.publish(task(priority=10), serializer="envelope", routing_key="sized")
        producer.publish(task(schedule_time=utcnow() + timedelta(hours=1)),
                         serializer="envelope", routing_key="sized")  # delayed: not waiting
        assert channel.queue_declare(queue="sized", passive=True).message_count == 3

        message = queue(channel).get()  # delivered but unacked: no longer waiting
        assert message is not None
        assert channel.queue_declare(queue="sized", passive=True).message_count == 2
        message.ack()
        assert channel.queue_declare(queue="sized", passive=True).message_count == 2

    def test_queue_purge_returns_the_count_and_empties_the_queue(
        self, connection: kombu.Connection, keys: KeySpace, redis_client: redis.Redis
    ) -> None:
        queue = Queue("purged")
        producer = connection.Producer()
        producer.publish({"plain": 1}, routing_key="purged", declare=[queue])
        producer.publish({"plain": 2}, routing_key="purged")
        for priority in (10, 100, 250):
            producer.publish(task(priority=priority), serializer="envelope",
                             routing_key="purged")
        producer.publish(task(schedule_time=utcnow() + timedelta(hours=1)),
                         serializer="envelope", routing_key="purged")

        channel = connection.default_channel
        assert channel.queue_purge("purged") == 6
        assert channel.queue_declare(queue="purged", passive=True).message_count == 0
        queue_keys = keys.queue("purged")
        assert total_length(redis_client, queue_keys.all_streams) == 0
        assert redis_client.zcard(queue_keys.delayed) == 0
        assert channel.queue_purge("purged") == 0

    # ------------------------------------------------- ack, reject, requeue

    def test_ack_deletes_the_stream_entry(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("acked")
        producer = connection.Producer()
        producer.publish({"plain": 1}, routing_key="acked", declare=[queue])
        producer.publish(task(), serializer="envelope", routing_key="acked")
        streams = keys.queue("acked").all_streams

        got = Collector(ack=False)
        with connection.Consumer([queue], callbacks=[got]):
            drain_until(connection, lambda: len(got) == 2)
            assert total_length(redis_client, streams) == 2
            assert sum(pending_count(redis_client, s, settings.consumer_group)
                       for s in streams) == 2
            for message in got.messages:
                message.ack()
        assert total_length(redis_client, streams) == 0
        assert sum(pending_count(redis_client, s, settings.consumer_group) for s in streams) == 0

    @pytest.mark.parametrize("requeue", ["reject", "requeue"])
    def test_rejected_with_requeue_is_delivered_again(
        self, connection: kombu.Connection, keys: KeySpace, key_prefix: str,
        redis_client: redis.Redis, requeue: str,
    ) -> None:
        queue = Queue("retried")
        producer = connection.Producer()
        producer.publish({"plain": 1}, routing_key="retried", declare=[queue])
        producer.publish(task(), serializer="envelope", routing_key="retried")

        got = Collector(ack=False)
        with connection.Consumer([queue], callbacks=[got]):
            drain_until(connection, lambda: len(got) == 2)
            first_bodies = got.bodies
            for message in list(got.messages):
                if requeue == "reject":
                    message.reject(requeue=True)
                else:
                    message.requeue()
            drain_until(connection, lambda: len(got) == 4)
            for message in got.messages[2:]:
                message.ack()
        assert sorted(map(json.dumps, got.bodies[2:])) == sorted(map(json.dumps, first_bodies))
        # Put back by a live consumer: redelivered, as with AMQP and kombu's redis transport.
        assert [m.delivery_info["redelivered"] for m in got.messages] == [False] * 2 + [True] * 2
        assert total_length(redis_client, keys.queue("retried").all_streams) == 0
        assert dead_letters(redis_client, key_prefix, "retried") == []

    def test_rejected_without_requeue_goes_to_the_dead_letter_stream_with_raw_fields(
        self, connection: kombu.Connection, keys: KeySpace, key_prefix: str,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("refused")
        queue_keys = keys.queue("refused")
        producer = connection.Producer()
        producer.publish({"plain": 1}, routing_key="refused", declare=[queue])
        producer.publish(task(), serializer="envelope", routing_key="refused")
        written = {fields_key(fields): fields
                   for stream in (queue_keys.kombu_stream, task_stream(queue_keys, 100))
                   for _, fields in stream_entries(redis_client, stream)}
        assert len(written) == 2

        got = Collector(ack=False)
        with connection.Consumer([queue], callbacks=[got]):
            drain_until(connection, lambda: len(got) == 2)
            for message in got.messages:
                message.reject(requeue=False)
            assert_nothing_delivered(connection)

        dead = dead_letters(redis_client, key_prefix, "refused")
        assert len(dead) == 2
        for entry in dead:
            assert entry["failure_class"] == b"rejected"
            assert entry["queue"] == b"refused"
            raw = {name[4:]: value for name, value in entry.items() if name.startswith("raw.")}
            assert raw == written[fields_key(raw)]
        assert total_length(redis_client, queue_keys.all_streams) == 0

    # ---------------------------------------------------------- priorities

    @pytest.mark.parametrize("prefetch_count", [1, 0])
    def test_envelope_tasks_are_served_highest_priority_first(
        self, connection: kombu.Connection, prefetch_count: int
    ) -> None:
        queue = Queue("prioritised")
        producer = connection.Producer()
        queue(connection.default_channel).declare()
        for priority in (10, 100, 250):  # all waiting before anybody consumes
            producer.publish(task(priority=priority), serializer="envelope",
                             routing_key="prioritised")

        got = Collector(ack=False)
        with connection.Consumer([queue], callbacks=[got]) as consumer:
            consumer.qos(prefetch_count=prefetch_count)
            while len(got) < 3:
                acked = len(got)
                drain_until(connection, lambda acked=acked: len(got) > acked)
                for message in got.messages[acked:]:
                    message.ack()
        assert [b["priority"] for b in got.bodies] == [250, 100, 10]
        assert [m.properties["priority"] for m in got.messages] == [250, 100, 10]

    def test_envelope_tasks_published_as_dicts_get_their_priority_bucket(
        self, connection: kombu.Connection, keys: KeySpace, redis_client: redis.Redis
    ) -> None:
        queue = Queue("dict-tasks")
        producer = connection.Producer()
        queue(connection.default_channel).declare()
        for priority in (10, 100, 250):
            producer.publish({"task_type": "report.build", "priority": priority},
                             serializer="envelope", routing_key="dict-tasks")
        queue_keys = keys.queue("dict-tasks")
        assert [redis_client.xlen(s) for s in queue_keys.task_streams] == [1, 1, 1]
        assert redis_client.xlen(queue_keys.kombu_stream) == 0

    def test_plain_kombu_messages_keep_their_priority_property(
        self, connection: kombu.Connection
    ) -> None:
        """Non-task messages share one ``kombu`` stream: delivered in publish order,
        their ``priority`` property intact, after the tasks waiting in the same queue."""
        queue = Queue("plain-priorities")
        producer = connection.Producer()
        queue(connection.default_channel).declare()
        for priority in (1, 9, 5):
            producer.publish({"p": priority}, priority=priority, routing_key="plain-priorities")
        producer.publish(task(priority=0), serializer="envelope",
                         routing_key="plain-priorities")

        got = Collector()
        with connection.Consumer([queue], callbacks=[got]):
            drain_until(connection, lambda: len(got) == 4)
        assert got.bodies[0]["task_type"] == "orders.close"
        assert got.bodies[1:] == [{"p": 1}, {"p": 9}, {"p": 5}]
        assert [m.properties["priority"] for m in got.messages[1:]] == [1, 9, 5]

    # ------------------------------------------------------- prefetch, no_ack

    def test_prefetch_count_bounds_unacked_deliveries(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("bounded")
        streams = keys.queue("bounded").all_streams
        producer = connection.Producer()
        queue(connection.default_channel).declare()
        # Spread over every stream of the queue: a read must not take one per stream.
        for n in range(10):
            if n % 4 == 3:
                producer.publish({"n": n}, routing_key="bounded")
            else:
                producer.publish(task(priority=(10, 100, 250)[n % 4]), serializer="envelope",
                                 routing_key="bounded")

        unacked: list[Any] = []
        most_unacked = 0
        most_pending = 0

        def on_message(body: Any, message: Any) -> None:
            nonlocal most_unacked
            unacked.append(message)
            most_unacked = max(most_unacked, len(unacked))

        received = 0
        with connection.Consumer([queue], callbacks=[on_message]) as consumer:
            consumer.qos(prefetch_count=2)
            while received < 10:
                expected = min(2, 10 - received)
                drain_until(connection, lambda expected=expected: len(unacked) == expected)
                if received + len(unacked) < 10:
                    assert_nothing_delivered(connection, 0.2)  # credit is used up
                most_pending = max(most_pending, sum(
                    pending_count(redis_client, s, settings.consumer_group) for s in streams))
                received += len(unacked)
                for message in unacked:
                    message.ack()
                unacked.clear()
        assert most_unacked == 2
        assert most_pending <= 2  # nothing read from Redis beyond the prefetch limit
        assert total_length(redis_client, streams) == 0

    def test_prefetch_count_bounds_unacked_deliveries_across_queues(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        """One blocking read per queue, each in its own slot: together they never take
        more than the credit, and every queue is served."""
        names = ["bounded-a", "bounded-b", "bounded-c"]
        queues = [Queue(name) for name in names]
        streams = [s for name in names for s in keys.queue(name).all_streams]
        producer = connection.Producer()
        for queue in queues:
            queue(connection.default_channel).declare()
        unacked: list[Any] = []
        most_pending = 0
        seen: set[str] = set()

        def on_message(body: Any, message: Any) -> None:
            unacked.append(message)
            seen.add(message.delivery_info["routing_key"])

        received = 0
        with connection.Consumer(queues, callbacks=[on_message]) as consumer:
            consumer.qos(prefetch_count=2)
            assert_nothing_delivered(connection, 0.2)  # every queue's read is blocked
            for n in range(12):
                producer.publish(task(), serializer="envelope", routing_key=names[n % 3])
            while received < 12:
                expected = min(2, 12 - received)
                drain_until(connection, lambda expected=expected: len(unacked) == expected)
                most_pending = max(most_pending, sum(
                    pending_count(redis_client, s, settings.consumer_group) for s in streams))
                received += len(unacked)
                for message in unacked:
                    message.ack()
                unacked.clear()
        assert most_pending <= 2  # nothing read from Redis beyond the prefetch limit
        assert seen == set(names)
        assert total_length(redis_client, streams) == 0

    def test_no_ack_consumer_removes_entries_on_delivery(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("fire-and-forget")
        streams = keys.queue("fire-and-forget").all_streams
        producer = connection.Producer()
        producer.publish({"n": 1}, routing_key="fire-and-forget", declare=[queue])
        producer.publish(task(), serializer="envelope", routing_key="fire-and-forget")

        got: list[Any] = []
        with connection.Consumer([queue], no_ack=True,
                                 callbacks=[lambda body, message: got.append(body)]):
            drain_until(connection, lambda: len(got) == 2)
            assert total_length(redis_client, streams) == 0
            assert sum(pending_count(redis_client, s, settings.consumer_group)
                       for s in streams) == 0
        assert {"n": 1} in got

    # ------------------------------------------ where messages are stored

    def test_envelope_published_from_kombu_is_stored_in_its_task_stream(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("stored")
        queue_keys = keys.queue("stored")
        envelope = task(priority=250, idempotency_key="order-7-close")
        connection.Producer().publish(envelope, serializer="envelope", routing_key="stored",
                                      declare=[queue])

        entries = stream_entries(redis_client, task_stream(queue_keys, 250))
        assert len(entries) == 1
        _, fields = entries[0]
        assert fields["v"] == b"1"
        assert fields["enc"] == (b"json+gzip" if settings.gzip_min_bytes == 0 else b"json")
        assert decode_entry(fields) == envelope
        others = (*[s for s in queue_keys.task_streams if s != task_stream(queue_keys, 250)],
                  queue_keys.kombu_stream)
        assert total_length(redis_client, others) == 0

    def test_plain_json_messages_are_stored_in_the_kombu_stream_only(
        self, connection: kombu.Connection, keys: KeySpace, redis_client: redis.Redis
    ) -> None:
        queue = Queue("plain")
        queue_keys = keys.queue("plain")
        producer = connection.Producer()
        producer.publish({"task_type": "looks.like.a.task"}, routing_key="plain",
                         declare=[queue])
        producer.publish({"n": 2}, routing_key="plain", priority=250)

        assert total_length(redis_client, queue_keys.task_streams) == 0
        entries = stream_entries(redis_client, queue_keys.kombu_stream)
        assert len(entries) == 2
        stored = json.loads(entries[0][1]["kombu"])
        assert stored["content-type"] == "application/json"
        body = connection.default_channel.decode_body(stored["body"],
                                                      stored["properties"]["body_encoding"])
        assert json.loads(body) == {"task_type": "looks.like.a.task"}

    # -------------------------------------------- refusing invalid Envelopes

    @pytest.mark.parametrize("body", [
        pytest.param({"task_type": "orders.close", "schedule_time": "2030-01-01T00:00:00"},
                     id="naive-schedule-time"),
        pytest.param({"task_type": "orders.close",
                      "payload": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}},
                     id="payload-too-deep"),
        pytest.param("100-days-ahead", id="schedule-time-100-days-ahead"),
    ])
    def test_invalid_envelope_is_refused_at_publish_and_nothing_is_written(
        self, connection: kombu.Connection, key_prefix: str, redis_client: redis.Redis,
        body: Any,
    ) -> None:
        if body == "100-days-ahead":
            body = task(schedule_time=utcnow() + timedelta(days=100))
        queue = Queue("strict")
        queue(connection.default_channel).declare()
        before = {k: redis_client.dump(k) for k in redis_client.keys(f"{key_prefix}:*")}

        with pytest.raises(InvalidEnvelope):
            connection.Producer().publish(body, serializer="envelope", routing_key="strict")

        after = {k: redis_client.dump(k) for k in redis_client.keys(f"{key_prefix}:*")}
        assert after == before

    def test_publish_validates_with_the_transport_limits(
        self, open_connection: Callable[..., kombu.Connection], keys: KeySpace,
        redis_client: redis.Redis,
    ) -> None:
        conn = open_connection(max_payload_depth=7)
        deep = {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}  # 6 levels: over the default of 5
        conn.Producer().publish({"task_type": "orders.close", "payload": deep},
                                serializer="envelope", routing_key="roomy",
                                declare=[Queue("roomy")])
        assert redis_client.xlen(task_stream(keys.queue("roomy"), 100)) == 1

    # ------------------------------------------- malformed and early entries

    @pytest.mark.parametrize("stream_name, fields", [
        pytest.param("normal", {"v": b"1", "enc": b"json", "body": b'{"task_type": "x"'},
                     id="body-is-not-json"),
        pytest.param("normal", {"v": b"1", "enc": b"json"}, id="no-body-field"),
        pytest.param("normal", {"v": b"9", "enc": b"json",
                                "body": b'{"task_type": "orders.close"}'},
                     id="unknown-wire-version"),
        pytest.param("normal", {"v": b"1", "enc": b"json+gzip",
                                "body": b"\x1f\x8b\x08garbage\xff\x00"},
                     id="gzip-body-is-garbage"),
        pytest.param("normal", {"v": b"1", "enc": b"json",
                                "body": b'{"task_type": "bad type!", "priority": 999}'},
                     id="json-fails-validation"),
        pytest.param("kombu", {"kombu": b"{not a kombu message"}, id="bad-kombu-entry"),
    ])
    def test_malformed_entry_is_dead_lettered_with_its_raw_bytes_and_consuming_goes_on(
        self, connection: kombu.Connection, keys: KeySpace, key_prefix: str,
        redis_client: redis.Redis, stream_name: str, fields: dict[str, bytes],
    ) -> None:
        queue = Queue("dirty")
        queue_keys = keys.queue("dirty")
        producer = connection.Producer()
        got = Collector()
        with connection.Consumer([queue], callbacks=[got]):
            redis_client.xadd(f"{queue_keys.base}:{stream_name}", fields)
            if stream_name == "kombu":
                producer.publish({"valid": True}, routing_key="dirty")
            else:
                producer.publish(task(), serializer="envelope", routing_key="dirty")
            drain_until(connection, lambda: len(got) == 1)

        body = got.bodies[0]
        assert body == {"valid": True} or body["task_type"] == "orders.close"
        dead = dead_letters(redis_client, key_prefix, "dirty")
        assert len(dead) == 1
        assert dead[0]["failure_class"] == b"malformed_entry"
        assert dead[0]["reason"]
        raw = {name[4:]: value for name, value in dead[0].items() if name.startswith("raw.")}
        assert raw == fields
        assert total_length(redis_client, queue_keys.all_streams) == 0

    def test_entry_added_before_its_schedule_time_waits_in_the_delayed_set(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis,
    ) -> None:
        queue = Queue("early")
        queue_keys = keys.queue("early")
        envelope = task(schedule_time=utcnow() + timedelta(seconds=2))
        got = Collector()
        with connection.Consumer([queue], callbacks=[got]):
            redis_client.xadd(task_stream(queue_keys, envelope.priority),
                              encode_entry(envelope, settings.gzip_min_bytes))
            assert_nothing_delivered(connection)  # the consumer reads it and sets it aside
            assert total_length(redis_client, queue_keys.all_streams) == 0
            assert redis_client.zscore(queue_keys.delayed, envelope.task_id) == \
                envelope.due_ms()

            promoter = Promoter(lambda: redis_client, settings)
            wait_for(lambda: promoter.run_once()[0] == 1, timeout=10,
                     message="the task was never promoted")
            drain_until(connection, lambda: len(got) == 1)
        assert utcnow() >= envelope.schedule_time
        assert got.bodies[0]["task_id"] == envelope.task_id

    # ----------------------------------------------------------- event loop

    def test_hub_delivers_messages_without_drain_events(
        self, connection: kombu.Connection
    ) -> None:
        queue = Queue("looped")
        producer = connection.Producer()
        queue(connection.default_channel).declare()
        hub = Hub()
        got = Collector()

        def run_hub_until(count: int, timeout: float = 10.0) -> None:
            deadline = time.monotonic() + timeout
            while len(got) < count:
                assert time.monotonic() < deadline, f"{len(got)} of {count} delivered"
                hub.run_once()

        try:
            connection.register_with_event_loop(hub)
            with connection.Consumer([queue], callbacks=[got]):
                hub.run_once()  # the consumer now waits on its socket, inside the hub
                producer.publish({"n": 1}, routing_key="looped")
                producer.publish(task(), serializer="envelope", routing_key="looped")
                run_hub_until(2)
                producer.publish({"n": 2}, routing_key="looped")
                run_hub_until(3)
        finally:
            hub.close()
        assert {"n": 1} in got.bodies[:2]
        assert any(b.get("task_type") == "orders.close" for b in got.bodies[:2])
        assert got.bodies[2] == {"n": 2}


    def test_under_a_hub_the_acks_of_one_read_go_together_once_it_is_delivered(
        self, connection: kombu.Connection, keys: KeySpace, settings: Settings,
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setattr(settle, "ACK_BATCH_S", 3600.0)  # only the deliveries decide
        queue = Queue("acked-together")
        queue(connection.default_channel).declare()
        producer = connection.Producer()
        for _ in range(3):
            producer.publish(task(), serializer="envelope", routing_key="acked-together")
        streams = keys.queue("acked-together").all_streams
        hub = Hub()
        got = Collector()  # acknowledges each message as it comes
        held = []
        try:
            connection.register_with_event_loop(hub)
            with connection.Consumer([queue], callbacks=[got]) as consumer:
                consumer.qos(prefetch_count=3)
                while len(got) < 3:
                    hub.run_once()
                    held.append(sum(pending_count(redis_client, s, settings.consumer_group)
                                    for s in streams))
                hub.run_once()  # nothing left to deliver: the acks go before it waits
                assert sum(pending_count(redis_client, s, settings.consumer_group)
                           for s in streams) == 0
        finally:
            hub.close()
        assert held[-1] == 3  # all three acknowledged, none settled while one was left
        assert total_length(redis_client, streams) == 0


class TestDefaultOptions(EnvelopeTransportBehaviour):
    """The transport as it comes."""

    options: ClassVar[dict[str, Any]] = {}


class TestGzipEveryBodyOwnConsumerGroup(EnvelopeTransportBehaviour):
    """Every task body compressed, and a consumer group other than the default."""

    options: ClassVar[dict[str, Any]] = {"gzip_min_bytes": 0, "consumer_group": "billing"}


# ------------------------------------------------------- connection parameters


def pool_of(conn: kombu.Connection) -> redis.ConnectionPool:
    """The connection pool the transport builds for ``conn`` (nothing connects yet)."""
    pool: redis.ConnectionPool = conn.transport.shared_client.connection_pool
    return pool


def test_envelopes_url_connects_over_tls() -> None:
    pool = pool_of(kombu.Connection("envelopes://cache.example:6380/2"))
    assert pool.connection_class is redis.SSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.example", 6380, 2)


def test_envelope_url_connects_without_tls() -> None:
    pool = pool_of(kombu.Connection("envelope://cache.example"))
    assert pool.connection_class is redis.Connection
    assert (pool.connection_kwargs["port"], pool.connection_kwargs["db"]) == (6379, 0)


def test_ssl_argument_turns_on_tls_with_its_options() -> None:
    pool = pool_of(kombu.Connection("envelope://cache.example:6380/0",
                                    ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED,
                                         "ssl_ca_certs": "/etc/ca.pem", "unrelated": 1}))
    assert pool.connection_class is redis.SSLConnection
    kwargs = pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert "unrelated" not in kwargs


def test_url_username_password_and_database_are_passed_to_redis() -> None:
    kwargs = pool_of(kombu.Connection("envelope://app-user:s3cr%40t@cache.example:6390/5")
                     ).connection_kwargs
    assert kwargs["username"] == "app-user"
    assert kwargs["password"] == "s3cr@t"
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("cache.example", 6390, 5)


def test_url_database_number_selects_the_redis_database(
    redis_url: str, key_prefix: str
) -> None:
    url = envelope_url(redis_url).rsplit("/", 1)[0] + "/3"
    with kombu.Connection(url, transport_options={"key_prefix": key_prefix}) as conn:
        conn.Producer().publish({"n": 1}, routing_key="in-db-3", declare=[Queue("in-db-3")])
    stream = KeySpace(key_prefix).queue("in-db-3").kombu_stream
    with redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3") as db3, \
            redis.Redis.from_url(redis_url) as db0:
        assert db3.xlen(stream) == 1
        assert not db0.exists(stream)


def test_ensure_connection_retries_and_fails_while_redis_is_unreachable() -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    retries: list[Exception] = []
    with kombu.Connection(f"envelope://127.0.0.1:{port}/0") as conn, \
            pytest.raises(OperationalError):
        conn.ensure_connection(errback=lambda exc, interval: retries.append(exc),
                               max_retries=2, interval_start=0, interval_step=0.01)
    assert len(retries) == 2
    assert all(isinstance(exc, redis.ConnectionError) for exc in retries)


# ----------------------------------------------------------------- isolation


def test_key_prefix_isolates_two_apps_on_one_redis(
    redis_url: str, key_prefix: str, redis_client: redis.Redis
) -> None:
    other_prefix = f"{key_prefix}-other"
    exchange = Exchange("jobs", "direct")
    queue = Queue("jobs", exchange, routing_key="jobs")
    with connect(redis_url, key_prefix, lease_ms=10_000) as app_a, \
            connect(redis_url, other_prefix, lease_ms=10_000) as app_b:
        Producer(app_a.default_channel, exchange=exchange).publish(
            {"app": "a"}, routing_key="jobs", declare=[queue])
        Producer(app_a.default_channel, exchange=exchange).publish(
            task(), serializer="envelope", routing_key="jobs")
        got_b = Collector()
        with Consumer(app_b, [queue], callbacks=[got_b]):
            assert_nothing_delivered(app_b)
        got_a = Collector()
        with Consumer(app_a, [queue], callbacks=[got_a]):
            drain_until(app_a, lambda: len(got_a) == 2)
    assert got_b.bodies == []
    assert {"app": "a"} in got_a.bodies
    other_keys = KeySpace(other_prefix).queue("jobs")
    assert total_length(redis_client, other_keys.all_streams) == 0
    assert dead_letters(redis_client, other_prefix, "jobs") == []
