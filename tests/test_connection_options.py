"""The connection options a Redis user expects from ``envelope://``, on real servers.

TLS (``envelopes://`` with a throw-away CA made by the ``openssl`` command),
passwords and ACL users, the database number, and the connect timeout; each one
through plain kombu and, where Celery has a setting of its own, a real
``celery worker``. Every server here is a private ``redis-server`` on 127.0.0.1,
and no connection leaves the loopback interface.
"""

from __future__ import annotations

import contextlib
import re
import select
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import kombu
import pytest
import redis
from apps.envelope_app import create_app
from kombu import Queue
from kombu.exceptions import OperationalError
from support.workers import CeleryWorker

from kombu_envelope import Envelope
from kombu_envelope.keys import KeySpace
from kombu_envelope.testing.redis_server import LOOPBACK, PrivateRedisServer

APP = "apps.envelope_app"
RESULT_TIMEOUT = 20
#: Plain-kombu deliveries even once ``celery_ext`` took over ``envelope://`` URLs.
ADAPTER = "kombu_envelope.kombu.adapter:MessageAdapter"
#: How long a refused connection may take to fail (it must fail, not hang).
FAIL_FAST_S = 5.0

#: Password of the ``default`` user (``requirepass``), with characters URLs must escape.
PASSWORD = "s3cr@t/pw:1"
ACL_USER, ACL_PASSWORD = "app", "s3cret"


# ------------------------------------------------------------------ helpers


def open_connection(url: str, key_prefix: str, **kwargs: Any) -> kombu.Connection:
    """A plain-kombu Connection whose keys all start with ``key_prefix``."""
    options = {"key_prefix": key_prefix, "message_adapter": ADAPTER,
               **kwargs.pop("transport_options", {})}
    return kombu.Connection(url, transport_options=options, **kwargs)


def publish_and_consume(conn: kombu.Connection, queue_name: str = "orders") -> None:
    """Publish an Envelope task on ``conn`` and consume (and ack) it there."""
    queue = Queue(queue_name)
    envelope = Envelope.new(task_type="orders.close", payload={"order_id": 7})
    conn.Producer().publish(envelope, serializer="envelope", routing_key=queue_name,
                            declare=[queue])
    bodies: list[dict[str, Any]] = []

    def on_message(body: dict[str, Any], message: kombu.Message) -> None:
        bodies.append(body)
        message.ack()

    deadline = time.monotonic() + 10
    with conn.Consumer([queue], callbacks=[on_message]):
        while not bodies:
            assert time.monotonic() < deadline, "the task was not delivered within 10s"
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
    assert [(b["task_id"], b["payload"]) for b in bodies] == [(envelope.task_id,
                                                               {"order_id": 7})]


def connection_failure(conn: kombu.Connection) -> OperationalError:
    """The error of ``ensure_connection(max_retries=1)``, which must come quickly.

    Two attempts with no pause between them: the time measured is the connecting's.
    """
    started = time.monotonic()
    with pytest.raises(OperationalError) as excinfo:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    elapsed = time.monotonic() - started
    assert elapsed < FAIL_FAST_S, f"failing took {elapsed:.1f}s"
    return excinfo.value


def keyspace(server: PrivateRedisServer, **client_options: Any) -> set[str]:
    """The databases of ``server`` that hold keys, e.g. ``{"db5"}``."""
    with redis.Redis(host=server.host, port=server.port, **client_options) as client:
        return set(client.info("keyspace"))


def worker_env(broker_url: str, result_backend: str, key_prefix: str) -> dict[str, str]:
    return {"TEST_BROKER_URL": broker_url, "TEST_RESULT_BACKEND": result_backend,
            "TEST_KEY_PREFIX": key_prefix, "TEST_LEASE_MS": "5000"}


# ---------------------------------------------------------------------- TLS

_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = placeholder

[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True)
class Certificates:
    """A throw-away CA and a server certificate (and key) for 127.0.0.1 it signed."""

    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path) -> Certificates:
    """Write a new CA and server certificate into ``directory`` with ``openssl``."""
    config = directory / "openssl.cnf"
    config.write_text(_OPENSSL_CONFIG)
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], cwd=directory, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"

    openssl("req", "-x509", "-new", *new_key, "-config", config.name, "-extensions", "ca",
            "-subj", "/CN=kombu-envelope test CA", "-days", "2",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-new", *new_key, "-config", config.name, "-subj", f"/CN={LOOPBACK}",
            "-keyout", "server.key", "-out", "server.csr")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-set_serial", str(time.time_ns()), "-days", "2",
            "-extfile", config.name, "-extensions", "server", "-out", "server.crt")
    return Certificates(ca=directory / "ca.crt", cert=directory / "server.crt",
                        key=directory / "server.key")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if shutil.which("openssl") is None:
        pytest.skip("the `openssl` command is not installed: no certificates for TLS tests")
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(certificates: Certificates) -> Iterator[PrivateRedisServer]:
    """A redis-server that speaks TLS only (its plain port is closed)."""
    server = PrivateRedisServer(tls=True, extra_config=[
        f'tls-cert-file "{certificates.cert}"',
        f'tls-key-file "{certificates.key}"',
        f'tls-ca-cert-file "{certificates.ca}"',
        "tls-auth-clients no",
    ])
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        if re.search(r"tls.*(bad directive|not supported|not built)", str(exc), re.I | re.S):
            pytest.skip(f"{server.binary} was built without TLS support")
        raise
    with server:
        yield server


def tls_url(server: PrivateRedisServer, scheme: str = "envelopes") -> str:
    return f"{scheme}://{server.host}:{server.port}/0"


def verified(certificates: Certificates) -> dict[str, Any]:
    """kombu's ``ssl`` argument (Celery's ``broker_use_ssl``) trusting the test CA."""
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(certificates.ca)}


def test_envelopes_url_checks_the_server_certificate_against_the_ca(
    tls_server: PrivateRedisServer, certificates: Certificates, key_prefix: str
) -> None:
    with open_connection(tls_url(tls_server), key_prefix, ssl=verified(certificates)) as conn:
        publish_and_consume(conn)


def test_envelopes_url_without_certificate_check(
    tls_server: PrivateRedisServer, key_prefix: str
) -> None:
    with open_connection(tls_url(tls_server), key_prefix,
                         ssl={"ssl_cert_reqs": ssl.CERT_NONE}) as conn:
        publish_and_consume(conn)


def test_a_server_certificate_from_an_untrusted_ca_is_refused(
    tls_server: PrivateRedisServer, key_prefix: str
) -> None:
    """No ``ssl_ca_certs``: only the system's CAs are trusted, and not the test CA."""
    with open_connection(tls_url(tls_server), key_prefix,
                         ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED}) as conn:
        error = connection_failure(conn)
    assert "certificate verify failed" in str(error)
    assert isinstance(error.__context__, redis.ConnectionError)


def test_plain_tcp_to_a_tls_port_fails_instead_of_hanging(
    tls_server: PrivateRedisServer, key_prefix: str
) -> None:
    with open_connection(tls_url(tls_server, scheme="envelope"), key_prefix) as conn:
        error = connection_failure(conn)
    assert isinstance(error.__context__, redis.ConnectionError)


def test_celery_worker_with_broker_use_ssl_runs_a_task(
    tls_server: PrivateRedisServer, certificates: Certificates, redis_url: str,
    key_prefix: str,
) -> None:
    """``broker_url=envelopes://...`` plus ``broker_use_ssl`` on both sides; results on
    the session's plain Redis."""
    broker_url = tls_url(tls_server)
    env = {**worker_env(broker_url, redis_url, key_prefix),
           "CELERY_CONFIG_MODULE": "support.tls_celeryconfig",
           "TEST_BROKER_CA_CERTS": str(certificates.ca)}
    app = create_app(broker_url, redis_url, key_prefix, 5000)
    app.conf.broker_use_ssl = verified(certificates)
    try:
        with CeleryWorker(APP, env=env) as worker:
            assert app.tasks["envelope_app.add"].delay(2, 3).get(timeout=RESULT_TIMEOUT) == 5
            connected = rf"Connected to envelopes://\S*{tls_server.host}:{tls_server.port}/0"
            assert re.search(connected, worker.log_text()), worker.log_tail()
    finally:
        app.close()
    with redis.Redis(host=tls_server.host, port=tls_server.port, ssl=True,
                     ssl_ca_certs=str(certificates.ca)) as client:
        assert client.exists(*KeySpace(key_prefix).queue("celery").all_streams)


# ------------------------------------------------------- password, ACL user


@pytest.fixture(scope="module")
def auth_server() -> Iterator[PrivateRedisServer]:
    """A server with a password for ``default`` and an ACL user ``app``.

    Both are set once the server answers, as the readiness PING carries no password.
    """
    with PrivateRedisServer() as server:
        with redis.Redis(host=server.host, port=server.port) as admin:
            admin.execute_command("ACL", "SETUSER", ACL_USER, "on", f">{ACL_PASSWORD}",
                                  "~*", "&*", "+@all")
            admin.config_set("requirepass", PASSWORD)
        yield server


def auth_url(server: PrivateRedisServer, user: str, password: str) -> str:
    credentials = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else ""
    return f"envelope://{credentials}{server.host}:{server.port}/0"


@pytest.mark.parametrize(("user", "password", "whoami"), [
    ("", PASSWORD, "default"),
    (ACL_USER, ACL_PASSWORD, ACL_USER),
], ids=["requirepass", "acl-user"])
def test_credentials_in_the_url_authenticate(
    auth_server: PrivateRedisServer, key_prefix: str, user: str, password: str, whoami: str
) -> None:
    with open_connection(auth_url(auth_server, user, password), key_prefix) as conn:
        publish_and_consume(conn)
        assert conn.default_channel.client.acl_whoami() == whoami


@pytest.mark.parametrize(("user", "password"), [
    ("", "wrong"),
    (ACL_USER, "wrong"),
    ("nobody", ACL_PASSWORD),
    ("", ""),
], ids=["wrong-password", "acl-user-wrong-password", "unknown-user", "no-password"])
def test_wrong_credentials_fail_with_an_authentication_error(
    auth_server: PrivateRedisServer, key_prefix: str, user: str, password: str
) -> None:
    with open_connection(auth_url(auth_server, user, password), key_prefix) as conn:
        error = connection_failure(conn)
    assert isinstance(error.__context__, redis.AuthenticationError), repr(error.__context__)


# ----------------------------------------------------------- database number


@pytest.fixture
def own_server() -> Iterator[PrivateRedisServer]:
    """An empty server for this test alone, so that every database can be checked."""
    with PrivateRedisServer() as server:
        yield server


def test_plain_kombu_on_database_5_leaves_the_others_empty(
    own_server: PrivateRedisServer, key_prefix: str
) -> None:
    url = f"envelope://{own_server.host}:{own_server.port}/5"
    with open_connection(url, key_prefix) as conn:
        publish_and_consume(conn)
    assert keyspace(own_server) == {"db5"}


def test_celery_worker_on_database_5_leaves_the_others_empty(
    own_server: PrivateRedisServer, key_prefix: str
) -> None:
    broker_url = f"envelope://{own_server.host}:{own_server.port}/5"
    result_backend = f"redis://{own_server.host}:{own_server.port}/5"
    app = create_app(broker_url, result_backend, key_prefix, 5000)
    try:
        with CeleryWorker(APP, env=worker_env(broker_url, result_backend, key_prefix)):
            assert app.tasks["envelope_app.add"].delay(4, 5).get(timeout=RESULT_TIMEOUT) == 9
    finally:
        app.close()
    assert keyspace(own_server) == {"db5"}
    with redis.Redis(host=own_server.host, port=own_server.port, db=5) as db5:
        assert db5.exists(*KeySpace(key_prefix).queue("celery").all_streams)


# ------------------------------------------------------------------ timeouts


@contextlib.contextmanager
def unanswered_address() -> Iterator[tuple[str, int]]:
    """A loopback address where TCP connects never complete.

    A listening socket that never accepts, its accept queue (backlog 0) filled by
    probes: the kernel then drops further connection requests without an answer.
    """
    with socket.socket() as listener, contextlib.ExitStack() as probes:
        listener.bind((LOOPBACK, 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(16):
            probe = probes.enter_context(socket.socket())
            probe.setblocking(False)
            probe.connect_ex(address)
            _, connected, _ = select.select([], [probe], [], 0.3)
            if not connected:
                break
        else:
            pytest.fail("the accept queue of a backlog-0 listening socket never filled")
        yield address


def test_socket_connect_timeout_bounds_connecting_to_an_address_that_never_answers(
    key_prefix: str,
) -> None:
    with unanswered_address() as (host, port), \
            open_connection(f"envelope://{host}:{port}/0", key_prefix,
                            transport_options={"socket_connect_timeout": 0.5}) as conn:
        started = time.monotonic()
        error = connection_failure(conn)
        elapsed = time.monotonic() - started
    assert isinstance(error.__context__, redis.TimeoutError), repr(error.__context__)
    assert elapsed >= 2 * 0.5  # two attempts, each waited for the full timeout
