"""A Redis error before a task's body runs hands the task back: never failed, never lost.

Real ``celery worker`` processes and real Redis servers: the claim of the
idempotency key fails because the broker's Redis is killed at that moment
(and restarted from its AOF), or because its ACL refuses the key; and, in this process, a
claim that landed but whose reply was lost. The result
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
from celery.exceptions import Ignore
from support import wait_for
from support.envelope_streams import dead_letters, envelope_url
from support.workers import CeleryWorker

from celery_ext.execution import ExecutionShell
from kombu_envelope.codec import decode_entry
from kombu_envelope.keys import Bucket, KeySpace
from kombu_envelope.kombu.delivery_info import INFO_CONSUMER, INFO_ENTRY_ID, INFO_QUEUE, INFO_STREAM
from kombu_envelope.store.idempotency import Idempotency
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
            # It first releases the claim its failed step may have set, waiting for Redis.
            worker.wait_for_log("releasing its idempotency key before it runs again failed",
                                timeout=RESULT_TIMEOUT)
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


def test_a_claim_whose_reply_was_lost_is_released_when_the_task_is_handed_back(
        redis_url: str, redis_client: redis.Redis, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``idem_begin.lua`` ran (the claim is set) but its reply never came back, as in a
    failover: the task is handed back, and the claim is released with it. Kept, it would
    make the next entry of the task (another entry id) find the key busy on this live
    consumer, deferred again and again until the claim expired an hour later."""
    app = create_app(envelope_url(redis_url), redis_url, key_prefix)
    shell = ExecutionShell(app)
    task = app.tasks["reliable.effect"]
    began = Idempotency.begin

    def reply_lost(self: Idempotency, *args: Any, **kwargs: Any) -> Any:
        began(self, *args, **kwargs)  # the claim lands...
        raise redis.ConnectionError("connection lost before the reply")  # ...unanswered

    monkeypatch.setattr(Idempotency, "begin", reply_lost)
    keys = KeySpace(key_prefix).queue("lost")
    stream = keys.stream(Bucket.NORMAL)
    task.apply_async(("o-4",), task_id="t-lost", queue="lost")
    ((_stream, ((entry_id, _fields),)),) = redis_client.xreadgroup(
        "workers", "worker-1", {stream: ">"}, count=1)  # delivered to this consumer
    info = {"exchange": "", "routing_key": "lost", INFO_QUEUE: "lost", INFO_CONSUMER: "worker-1",
            INFO_STREAM: stream,
            INFO_ENTRY_ID: entry_id.decode()}
    task.push_request(id="t-lost", args=["o-4"], kwargs={}, retries=0,
                      headers={"idempotency_key": "o-4"}, delivery_info=info,
                      properties={"delivery_info": info})
    try:
        with pytest.raises(Ignore):
            shell.execute(task, task.run, task.retry, ("o-4",), {})
    finally:
        task.pop_request()
        app.close()
    assert redis_client.get(f"{key_prefix}:idem:reliable.effect:o-4") is None  # released
    assert counter(redis_client, key_prefix, "effects", "o-4") == 0  # not run
    # Published again: the same task, to run a moment later.
    again = [decode_entry(f).task_id for i, f in redis_client.xrange(stream) if i != entry_id]
    assert again == ["t-lost"] or redis_client.zscore(keys.delayed, "t-lost"), again
