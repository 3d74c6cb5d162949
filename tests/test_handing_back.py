"""A Redis error before a task's body runs hands the task back: never failed, never lost.

Real ``celery worker`` processes and real Redis servers: the claim of the
idempotency key fails because the broker's Redis is killed at that moment
(and restarted from its AOF), or because its ACL refuses the key. The result
backend is another Redis, so a FAILURE would be recorded there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from apps.reliable_app import create_app
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import CeleryWorker

from kombu_envelope.testing.redis_server import PrivateRedisServer

APP = "apps.reliable_app"
HANDED_BACK = "Redis failed while claiming its idempotency key"
RESULT_TIMEOUT = 60


def counter(client: redis.Redis, prefix: str, what: str, order_id: str) -> int:
    return int(client.get(f"{prefix}:probe:{what}:{order_id}") or 0)


@pytest.mark.parametrize("acks_late", ["0", "1"], ids=["early-acks", "acks-late"])
def test_a_claim_during_a_redis_outage_hands_the_task_back(
        private_redis: PrivateRedisServer, redis_url: str, redis_client: redis.Redis,
        key_prefix: str, tmp_path: Path, acks_late: str) -> None:
    # Early acks are Celery's default: then the published copy is the only one left.
    broker = envelope_url(private_redis.url)
    env = {"TEST_BROKER_URL": broker, "TEST_RESULT_BACKEND": redis_url,
           "TEST_KEY_PREFIX": key_prefix, "TEST_ACKS_LATE": acks_late}
    app = create_app(broker, redis_url, key_prefix)
    pause = tmp_path / "pause"
    try:
        with CeleryWorker(APP, pool="prefork", env=env) as worker:
            result = app.tasks["reliable.effect"].delay("o-1", pause_before_claim=str(pause))
            wait_for(lambda: Path(f"{pause}.ready").exists(), timeout=30,
                     message=worker.log_tail)
            private_redis.kill()  # between the delivery and the claim
            Path(f"{pause}.go").touch()
            worker.wait_for_log(HANDED_BACK, timeout=RESULT_TIMEOUT)
            worker.wait_for_log("publishing it again failed", timeout=RESULT_TIMEOUT)
            assert result.state == "PENDING"  # not FAILURE
            private_redis.start()  # from its AOF
            assert result.get(timeout=RESULT_TIMEOUT) == 1
            assert counter(redis_client, key_prefix, "started", "o-1") == 1
            assert counter(redis_client, key_prefix, "effects", "o-1") == 1
            assert worker.is_alive()
    finally:
        app.close()


@contextlib.contextmanager
def acl_user(client: redis.Redis, key_prefix: str, keys: str) -> Iterator[tuple[str, str]]:
    """An ACL user that may use the keys matching ``keys``, every command and channel."""
    user, password = f"{key_prefix}-worker", "s3cret"
    client.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{keys}", "&*",
                           "+@all")
    try:
        yield user, password
    finally:
        client.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize(("refused", "task", "args", "step", "outcome"), [
    # <prefix>:idem:* is the only key after the prefix starting with "i", retrying:* with "r".
    ("i", "reliable.effect", ("o-2",), "claiming its idempotency key", 1),
    ("r", "reliable.flaky", ("f-2", 1), "taking a retry slot", {"retries": 1, "fast": "1"}),
])
def test_a_claim_refused_by_redis_hands_the_task_back_until_it_is_allowed(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, refused: str, task: str,
        args: tuple[Any, ...], step: str, outcome: Any) -> None:
    parts = urlsplit(redis_url)
    app = create_app(envelope_url(redis_url), redis_url, key_prefix)
    try:
        with acl_user(redis_client, key_prefix, f"{key_prefix}:[^{refused}]*") as (user, pw):
            env = {"TEST_BROKER_URL": f"envelope://{user}:{pw}@{parts.hostname}:{parts.port}/0",
                   "TEST_RESULT_BACKEND": redis_url, "TEST_KEY_PREFIX": key_prefix,
                   "TEST_ACKS_LATE": "0"}  # Celery's default
            with CeleryWorker(APP, pool="prefork", env=env) as worker:
                result = app.tasks[task].delay(*args)
                # NOPERM on every delivery: handed back each time, a few tenths of a second later.
                wait_for(lambda: worker.log_text().count(f"Redis failed while {step}") >= 2,
                         timeout=30, message=worker.log_tail)
                assert "NoPermissionError" in worker.log_text()
                assert result.state in ("PENDING", "RETRY")  # not FAILURE
                assert dead_letters(redis_client, key_prefix, "celery") == []
                redis_client.execute_command("ACL", "SETUSER", user, "allkeys")
                assert result.get(timeout=RESULT_TIMEOUT) == outcome
    finally:
        app.close()
    name = args[0]
    if task == "reliable.effect":  # the body ran once, after the ACL allowed its key
        assert counter(redis_client, key_prefix, "started", name) == 1
        assert counter(redis_client, key_prefix, "effects", name) == 1
    else:  # the first attempt and the retry that finally got its slot
        assert redis_client.llen(f"{key_prefix}:probe:attempts:{name}") == 2
