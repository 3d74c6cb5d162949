"""Redis Sentinel end to end, failovers ridden out, and the ``wait_replicas`` option.

Every test runs real processes from the redis-server binary on loopback ports: a
Sentinel group (a primary, two replicas, three sentinels) from
:class:`~kombu_envelope.testing.sentinel.SentinelGroup`, or a primary with one
replica. The small Sentinel drills at the end run Celery, Go, Node.js and Java workers
through a SIGKILL of the primary while a burst of delayed tasks is being promoted, and a
SIGSTOP of the next primary (``python -m bench drill --topology sentinel`` runs the
large one); the drill without WAIT runs only with ``KOMBU_ENVELOPE_LONG_DRILLS=1``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import kombu
import pytest
import redis
from celery import Celery
from redis.exceptions import AuthenticationError, ClusterDownError, ReadOnlyError, TryAgainError
from redis.sentinel import MasterNotFoundError
from support import wait_for
from support.workers import PROJECT_ROOT, TESTS_DIR
from test_connection_options import Certificates
from test_connection_options import certificates as certificates  # the fixture

import celery_ext  # noqa: F401  (envelope:// for Celery)
from bench.drill.config import LANGUAGES, SENTINEL_SMALL
from bench.drill.run import run_drill
from kombu_envelope import Envelope
from kombu_envelope.keys import bucket_for
from kombu_envelope.kombu.transport import Transport
from kombu_envelope.settings import Settings
from kombu_envelope.store import replication
from kombu_envelope.store.client import client_for_url, close_client
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.testing.redis_server import LOOPBACK, PrivateRedisServer
from kombu_envelope.testing.sentinel import SentinelGroup

QUEUE = "ha"


@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    """One Sentinel group for the tests that do not fail it over."""
    with SentinelGroup(password="data-secret", sentinel_password="sentinel-secret") as group:
        yield group


@pytest.fixture
def primary_with_replica() -> Iterator[tuple[PrivateRedisServer, PrivateRedisServer]]:
    with PrivateRedisServer() as primary, PrivateRedisServer(
            extra_config=[f"replicaof {LOOPBACK} {primary.port}"]) as replica:
        client = redis.Redis.from_url(primary.url)
        wait_for(lambda: client.info("replication").get("slave0", {}).get("state") == "online",
                 timeout=15)
        client.close()
        yield primary, replica


def new_envelope(**fields: object) -> Envelope:
    return Envelope.new(task_type="ha.effect", payload={"n": 1}, **fields)  # type: ignore[arg-type]


# ----------------------------------------------------------- Sentinel itself


def test_the_primary_is_found_through_sentinels_with_their_own_password(
        group: SentinelGroup, key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix, master_name=group.master_name,
                        sentinel_kwargs=group.sentinel_kwargs)
    client = client_for_url(group.url, settings)
    try:
        entry_id = Publisher(client, settings).publish(QUEUE, new_envelope())
        with group.client(group.primary) as direct:
            found = [s for s in settings.keys.queue(QUEUE).task_streams
                     if direct.xrange(s, entry_id, entry_id)]
        assert len(found) == 1
    finally:
        close_client(client)


@pytest.fixture(scope="module")
def split_sentinels() -> Iterator[tuple[PrivateRedisServer, PrivateRedisServer,
                                        list[PrivateRedisServer]]]:
    """Two unrelated primaries X and Y, and three sentinels that disagree under one name:
    the first monitors X, the other two monitor Y (a sentinel left behind by a failover,
    or pointed at a restarted old primary, answers like the first)."""
    with PrivateRedisServer() as x, PrivateRedisServer() as y:
        sentinels = [PrivateRedisServer(sentinel=True, extra_config=[
            f"sentinel monitor split {LOOPBACK} {primary.port} 1"]) for primary in (x, y, y)]
        try:
            for sentinel in sentinels:
                sentinel.start()
            yield x, y, sentinels
        finally:
            for sentinel in sentinels:
                sentinel.close()


def _sentinel_url(sentinels: list[PrivateRedisServer]) -> str:
    return ";".join(f"envelope-sentinel://{LOOPBACK}:{s.port}/0" for s in sentinels)


def test_the_primary_is_the_one_a_majority_of_sentinels_name(split_sentinels: tuple[
        PrivateRedisServer, PrivateRedisServer, list[PrivateRedisServer]]) -> None:
    x, y, sentinels = split_sentinels
    settings = Settings(key_prefix="split", master_name="split", outage_tolerance_s=0)
    client = client_for_url(_sentinel_url(sentinels), settings)  # X's sentinel listed first
    try:
        entry_id = Publisher(client, settings).publish(QUEUE, new_envelope())
    finally:
        close_client(client)
    streams = settings.keys.queue(QUEUE).task_streams
    with redis.Redis(port=y.port) as on_y, redis.Redis(port=x.port) as on_x:
        assert [s for s in streams if on_y.xrange(s, entry_id, entry_id)]
        assert not on_x.keys("split:*")

    with PrivateRedisServer() as gone:  # a sentinel that is down, listed first: asked once
        gone.stop()
        started = time.monotonic()
        client = client_for_url(_sentinel_url([gone, *sentinels[1:]]), settings)
        try:
            client.ping()
        finally:
            close_client(client)
        assert time.monotonic() - started < 3, "the sentinel that is down was asked again"

    split = client_for_url(_sentinel_url(sentinels[:2] + sentinels[1:2]), settings)  # one vote
    # each: the second listed twice still votes once
    try:
        with pytest.raises(MasterNotFoundError, match=r"2 of 2 sentinels must name the same "
                                                      r"primary, they name \{"):
            split.ping()
    finally:
        close_client(split)
    with redis.Redis(port=x.port) as on_x:
        assert not on_x.keys("split:*")


def test_sentinels_refusing_the_password_fail_at_once_naming_the_refusal(
        group: SentinelGroup) -> None:
    settings = Settings(master_name=group.master_name, sentinel_kwargs={"password": "wrong"},
                        outage_tolerance_s=30)
    client = client_for_url(group.url, settings)
    started = time.monotonic()
    try:
        with pytest.raises(AuthenticationError, match=r"sentinels must name the same primary.*"
                                                      r"invalid username-password"):
            Publisher(client, settings).publish(QUEUE, new_envelope())
    finally:
        close_client(client)
    assert time.monotonic() - started < 10, "retried as an outage"


def test_kombu_connection_on_sentinel_publishes_and_consumes(group: SentinelGroup,
                                                           key_prefix: str) -> None:
    options = {"key_prefix": key_prefix, "message_adapter": None, **group.transport_options()}
    received: list[object] = []
    with kombu.Connection(group.url, transport=Transport, transport_options=options) as conn:
        queue = kombu.Queue(QUEUE, exchange=kombu.Exchange(QUEUE), routing_key=QUEUE)
        with conn.Producer() as producer:
            producer.publish({"hello": "sentinel"}, exchange=queue.exchange,
                             routing_key=QUEUE, declare=[queue])
        with conn.Consumer(queue, callbacks=[lambda body, m: (received.append(body),
                                                              m.ack())]):
            conn.drain_events(timeout=5)
    assert received == [{"hello": "sentinel"}]


def _environment(**extra: str) -> dict[str, str]:
    paths = [str(PROJECT_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)),
            "PYTHONUNBUFFERED": "1", **extra}


def test_the_standalone_scheduler_and_the_cli_work_on_sentinel(group: SentinelGroup,
                                                             key_prefix: str) -> None:
    settings = Settings(key_prefix=key_prefix, master_name=group.master_name,
                        sentinel_kwargs=group.sentinel_kwargs)
    client = client_for_url(group.url, settings)
    soon = datetime.now(timezone.utc) + timedelta(seconds=1)
    Publisher(client, settings).publish(QUEUE, new_envelope(schedule_time=soon))
    close_client(client)
    options = {"key_prefix": key_prefix, **group.transport_options()}
    cli_env = _environment(DRILL_BROKER_URL=group.url,
                           DRILL_TRANSPORT_OPTIONS=json.dumps(options))
    counted = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "bench.drill.app", "envelope", "delayed",
         "count", "--json"], cwd=PROJECT_ROOT, env=cli_env, capture_output=True, text=True,
        timeout=60)
    assert counted.returncode == 0, counted.stderr
    assert json.loads(counted.stdout) == {QUEUE: 1}
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "kombu_envelope.scheduler", "--url", group.url,
         "--master-name", group.master_name, "--key-prefix", key_prefix],
        cwd=PROJECT_ROOT, env=_environment(ENVELOPE_SENTINEL_PASSWORD=group.sentinel_password
                                           or ""),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with group.client(group.primary) as direct:
            wait_for(lambda: sum(direct.xlen(s) for s in
                                 settings.keys.queue(QUEUE).task_streams) >= 1, timeout=20)
    finally:
        scheduler.send_signal(signal.SIGTERM)
        output, _ = scheduler.communicate(timeout=30)
    assert scheduler.returncode == 0, output


def test_sentinel_over_tls_checks_certificates_of_sentinels_and_data_nodes(
        certificates: Certificates, key_prefix: str) -> None:
    lines = [f'tls-cert-file "{certificates.cert}"', f'tls-key-file "{certificates.key}"',
             f'tls-ca-cert-file "{certificates.ca}"', "tls-auth-clients no"]
    verify = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(certificates.ca)}
    with SentinelGroup(tls_config=lines, sentinels=3) as tls_group:
        assert tls_group.url.startswith("envelopes-sentinel://")
        settings = Settings(key_prefix=key_prefix, master_name=tls_group.master_name,
                            sentinel_kwargs={"ssl": True, **verify})
        client = client_for_url(tls_group.url, settings, ssl=verify)
        try:
            assert Publisher(client, settings).publish(QUEUE, new_envelope())
        finally:
            close_client(client)
        untrusted = Settings(master_name=tls_group.master_name, outage_tolerance_s=0,
                             sentinel_kwargs={"ssl": True, "ssl_cert_reqs": "required"})
        client = client_for_url(tls_group.url, untrusted, ssl=verify)
        try:
            with pytest.raises(MasterNotFoundError, match="certificate verify failed"):
                client.ping()
        finally:
            close_client(client)


# ---------------------------------------------------------- failover errors


def test_failover_replies_are_connection_errors_to_kombu_and_celery() -> None:
    for error in (ReadOnlyError, ClusterDownError, TryAgainError, redis.ConnectionError,
                  redis.TimeoutError):
        assert issubclass(error, Transport.connection_errors), error


def test_a_publish_to_a_demoted_primary_waits_until_it_is_primary_again(
        primary_with_replica: tuple[PrivateRedisServer, PrivateRedisServer],
        key_prefix: str) -> None:
    primary, replica = primary_with_replica
    settings = Settings(key_prefix=key_prefix, outage_tolerance_s=10)
    client = client_for_url(primary.url, settings)
    admin = redis.Redis.from_url(primary.url)
    try:
        client.ping()  # the pool has answered: READONLY is an outage from now on
        admin.replicaof(LOOPBACK, replica.port)  # demoted: writes answer READONLY
        threading.Timer(1.0, admin.replicaof, args=("NO", "ONE")).start()
        started = time.monotonic()
        entry_id = Publisher(client, settings).publish(QUEUE, new_envelope())
        waited = time.monotonic() - started
        assert entry_id is not None
        assert waited >= 0.8, f"the publish went through a replica after {waited:.2f} s"
        stored = sum(admin.xlen(s) for s in settings.keys.queue(QUEUE).task_streams)
        assert stored == 1
    finally:
        close_client(client)
        admin.close()


# ----------------------------------------------------------------- WAIT


def _paused(servers: list[PrivateRedisServer]) -> object:
    class Paused:
        def __enter__(self) -> None:
            for server in servers:
                os.kill(server.pid or 0, signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            for server in servers:
                os.kill(server.pid or 0, signal.SIGCONT)
    return Paused()


def test_wait_replicas_waits_on_the_connection_that_wrote_and_logs_a_short_wait(
        primary_with_replica: tuple[PrivateRedisServer, PrivateRedisServer],
        key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    primary, replica = primary_with_replica
    settings = Settings(key_prefix=key_prefix, wait_replicas=1, wait_timeout_ms=1500)
    client = client_for_url(primary.url, settings)
    publisher = Publisher(client, settings)
    try:
        publisher.publish(QUEUE, new_envelope())  # the replica answers: no warning
        assert not [r for r in caplog.records if "replicas wait_replicas" in r.message]
        before = replication.short_waits()
        # A stopped replica is still connected: a WAIT sent on a connection without
        # writes would count it at once. Only the writing connection's WAIT times out.
        with caplog.at_level(logging.WARNING), _paused([replica]):
            started = time.monotonic()
            publisher.publish_many([(QUEUE, new_envelope()), (QUEUE, new_envelope())])
            waited = time.monotonic() - started
        assert waited >= 1.4
        assert replication.short_waits() == before + 1
        assert any("publish acknowledged by 0 of the 1 replicas" in r.message
                   for r in caplog.records)
        with redis.Redis.from_url(replica.url) as on_replica:
            wait_for(lambda: sum(on_replica.xlen(s) for s in
                                 settings.keys.queue(QUEUE).task_streams) == 3, timeout=10)
    finally:
        close_client(client)


def test_celery_publishes_and_acks_under_wait_replicas_are_on_the_replica_on_return(
        primary_with_replica: tuple[PrivateRedisServer, PrivateRedisServer],
        key_prefix: str) -> None:
    primary, replica = primary_with_replica
    options = {"key_prefix": key_prefix, "wait_replicas": 1, "wait_timeout_ms": 1500}
    settings = Settings.from_transport_options(options)
    app = Celery("ha", broker=f"envelope://{LOOPBACK}:{primary.port}/0")
    app.conf.update(broker_transport_options=options, task_default_queue=QUEUE)
    stream = settings.keys.queue(QUEUE).stream(bucket_for(100))
    with redis.Redis.from_url(replica.url) as on_replica:
        for _ in range(3):
            app.send_task("ha.effect", kwargs={"n": 1})
        # Each publish waited for the replica: it has every entry when send_task returned.
        assert on_replica.xlen(stream) == 3
        lengths: list[int] = []

        def on_message(body: object, message: kombu.Message) -> None:
            message.ack()
            if body[1] == {"n": 1}:  # type: ignore[index]  # the replica is paused for n=2
                lengths.append(on_replica.xlen(stream))

        with app.connection_for_read() as conn, \
                conn.Consumer(kombu.Queue(QUEUE), callbacks=[on_message],
                              accept=["json"]):
            for _ in range(3):
                conn.drain_events(timeout=5)
            # Each ack (XACK + XDEL in MULTI, then WAIT) was on the replica on return.
            assert lengths == [2, 1, 0]
            app.send_task("ha.effect", kwargs={"n": 2})
            before = replication.short_waits()
            with _paused([replica]):  # the ack's own WAIT times out, and says so
                started = time.monotonic()
                conn.drain_events(timeout=5)
                waited = time.monotonic() - started
    app.close()
    assert waited >= 1.4
    assert replication.short_waits() == before + 1
    assert on_replica_eventually_empty(replica, stream)


def on_replica_eventually_empty(replica: PrivateRedisServer, stream: str) -> bool:
    with redis.Redis.from_url(replica.url) as on_replica:
        wait_for(lambda: on_replica.xlen(stream) == 0, timeout=10)
    return True


# ------------------------------------------------------------------ drills

#: The long drills (``KOMBU_ENVELOPE_LONG_DRILLS=1``) run only when asked.
LONG_DRILLS = os.environ.get("KOMBU_ENVELOPE_LONG_DRILLS") == "1"


@pytest.mark.slow
@pytest.mark.timeout(300)  # peer builds included; the drill's own deadlines end it first
def test_sentinel_drill_with_wait_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    # Every replica: behind Sentinel a WAIT for fewer may be answered by one the sentinels
    # do not promote (docs/protocol.md, section 5).
    report = run_drill(SENTINEL_SMALL.replace(wait_replicas=2, languages=LANGUAGES), tmp_path)
    if not report.passed:
        pytest.fail(report.diagnostics(), pytrace=False)
    assert report.tally.lost == [] and not report.exited
    assert set(report.languages.values()) == set(LANGUAGES)  # every one started and was ready
    assert report.tally.effects == SENTINEL_SMALL.tasks + SENTINEL_SMALL.burst


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not LONG_DRILLS, reason="a long drill: set KOMBU_ENVELOPE_LONG_DRILLS=1")
def test_sentinel_drill_without_wait_reports_its_loss(tmp_path: Path) -> None:
    report = run_drill(SENTINEL_SMALL, tmp_path)
    if not report.passed:
        pytest.fail(report.diagnostics(), pytrace=False)
    assert "lost" in report.figures() and not report.exited
    assert report.tally.duplicate_effects == 0
    assert set(report.failover_s) == {"kill", "stall"}
