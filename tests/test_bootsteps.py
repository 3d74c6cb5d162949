"""The worker bootstep that runs the delayed-task promoter in a thread."""

from __future__ import annotations

import importlib
import re
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu.transport import TRANSPORT_ALIASES
from support import wait_for
from support.workers import CeleryWorker

import kombu_envelope
from celery_ext import protocol
from celery_ext.bootsteps import (
    DelayedTaskPromoter,
    add_worker_steps,
    install_worker_steps,
    uses_envelope_broker,
)
from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.envelope import utcnow
from kombu_envelope.keys import QueueKeys

try:
    import celery_ext  # registers envelope:// for Celery
except ImportError:  # pragma: no cover - the package is being written
    celery_ext = None
if celery_ext is None or getattr(celery_ext, "__file__", None) is None:  # pragma: no cover
    try:
        importlib.import_module("celery_ext.transport")
        kombu_envelope.register_transport("celery_ext.transport:Transport")
    except ImportError:
        kombu_envelope.register_transport("kombu_envelope.kombu.transport:Transport")

QUEUE = "celery"


def envelope_url(redis_url: str) -> str:
    scheme, rest = redis_url.split("://", 1)
    return ("envelopes" if scheme == "rediss" else "envelope") + "://" + rest


def due_in(seconds: float) -> Envelope:
    return Envelope.new(task_type="boot.test", schedule_time=utcnow() + timedelta(seconds=seconds))


def stream_len(client: redis.Redis, keys: QueueKeys) -> int:
    return sum(client.xlen(stream) for stream in keys.task_streams)


def subscribers(client: redis.Redis, channel: str) -> int:
    return int(dict(client.pubsub_numsub(channel)).get(channel.encode(), 0))


@pytest.fixture
def app(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = Celery("bootsteps_test", broker=envelope_url(redis_url), set_as_current=False)
    app.conf.broker_transport_options = {"key_prefix": key_prefix}
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def keys(key_prefix: str) -> QueueKeys:
    return Settings(key_prefix=key_prefix).keys.queue(QUEUE)


@pytest.fixture
def publisher(redis_client: redis.Redis, key_prefix: str) -> Publisher:
    return Publisher(redis_client, Settings(key_prefix=key_prefix))


def fake_worker(app: Celery) -> SimpleNamespace:
    """What the bootstep uses of a WorkController."""
    return SimpleNamespace(app=app, steps=[])


def test_alias_points_at_an_envelope_transport(app: Celery) -> None:
    assert TRANSPORT_ALIASES["envelope"].endswith(":Transport")
    assert uses_envelope_broker(app)
    other = Celery("other", broker="memory://", set_as_current=False)
    assert not uses_envelope_broker(other)


def test_step_promotes_delayed_tasks_while_it_runs(
    app: Celery, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    worker = fake_worker(app)
    step = DelayedTaskPromoter(worker)
    assert step.include(worker)
    assert worker.steps == [step]
    channel = Settings(key_prefix=key_prefix).keys.wakeup_channel

    step.start(worker)
    try:
        assert step.obj.settings.key_prefix == key_prefix  # from broker_transport_options
        wait_for(lambda: subscribers(redis_client, channel) == 1)
        task = due_in(0.3)
        assert publisher.publish(QUEUE, task) is None
        wait_for(lambda: stream_len(redis_client, keys) == 1, timeout=5,
                 message="delayed task not promoted by the bootstep")
        assert redis_client.zcard(keys.delayed) == 0
    finally:
        step.stop(worker)
    assert not step.obj._thread.is_alive()
    wait_for(lambda: subscribers(redis_client, channel) == 0)

    # Stopped: nothing is promoted any more.
    publisher.publish(QUEUE, due_in(0.1))
    time.sleep(0.4)
    assert redis_client.zcard(keys.delayed) == 1
    assert stream_len(redis_client, keys) == 1


def test_setting_disables_the_step(
    app: Celery, redis_client: redis.Redis, key_prefix: str, keys: QueueKeys,
    publisher: Publisher,
) -> None:
    app.conf.envelope_promoter_enabled = False
    worker = fake_worker(app)
    step = DelayedTaskPromoter(worker)
    assert not step.include(worker)
    assert worker.steps == []
    step.start(worker)  # what the blueprint would do if it were included anyway
    try:
        publisher.publish(QUEUE, due_in(0.1))
        time.sleep(0.5)
        assert redis_client.zcard(keys.delayed) == 1
        assert stream_len(redis_client, keys) == 0
        assert subscribers(redis_client, Settings(key_prefix=key_prefix).keys.wakeup_channel) == 0
    finally:
        step.stop(worker)


def test_step_is_left_out_for_other_brokers() -> None:
    app = Celery("other", broker="memory://", set_as_current=False)
    worker = fake_worker(app)
    assert not DelayedTaskPromoter(worker).include(worker)
    assert worker.steps == []


def test_add_worker_steps_and_the_worker_init_receiver(app: Celery) -> None:
    assert DelayedTaskPromoter not in app.steps["worker"]
    add_worker_steps(app)
    assert DelayedTaskPromoter in app.steps["worker"]

    other = Celery("other", broker="memory://", set_as_current=False)
    install_worker_steps(sender=SimpleNamespace(app=other))
    install_worker_steps(sender=SimpleNamespace(app=other))
    add_worker_steps(other)
    assert [s for s in other.steps["worker"] if s is DelayedTaskPromoter] == [DelayedTaskPromoter]
    install_worker_steps(sender=None)  # no worker: nothing to do


# The worker runs in this process: Celery's Redis result backend calls redis-py's setex.
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_celery_test_worker_runs_countdown_and_eta_tasks(
    redis_url: str, redis_client: redis.Redis, key_prefix: str,
) -> None:
    """``start_worker`` (the ``celery_worker`` fixture) sends worker_init, not celeryd_init."""
    app = Celery("test_worker_app", broker=envelope_url(redis_url), backend=redis_url,
                 set_as_current=False)
    app.conf.update(broker_transport_options={"key_prefix": key_prefix},
                    result_backend_transport_options={"global_keyprefix": f"{key_prefix}:"})
    app.loader.import_task_module("celery.contrib.testing.tasks")  # celery.ping

    @app.task(name="test_worker_app.add")
    def add(x: int, y: int) -> int:
        return x + y

    channel = Settings(key_prefix=key_prefix).keys.wakeup_channel
    try:
        with start_worker(app, pool="solo"):
            assert subscribers(redis_client, channel) == 1  # one promoter in this worker
            started = time.monotonic()
            by_countdown = add.apply_async((1, 2), countdown=1)
            by_eta = add.apply_async((2, 3), eta=utcnow() + timedelta(seconds=1))
            assert by_countdown.get(timeout=20) == 3
            assert by_eta.get(timeout=20) == 5
            assert time.monotonic() - started >= 1
        wait_for(lambda: subscribers(redis_client, channel) == 0)  # stopped with the worker
    finally:
        protocol.set_worker_app(None)  # worker_init made it this process's worker app
        app.close()


WORKER_APP = """
import os
import time

import celery_ext  # noqa: F401
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_ext.bootsteps import add_worker_steps

app = Celery("promoter_app", broker=os.environ["TEST_BROKER_URL"])
app.conf.update(
    broker_transport_options={"key_prefix": os.environ["TEST_KEY_PREFIX"]},
    broker_connection_retry_on_startup=True,
    envelope_promoter_enabled=os.environ.get("TEST_PROMOTER", "1") == "1",
)
add_worker_steps(app)


@app.task(name="promoter_app.sleep")
def sleep(seconds):
    print("sleep task started", flush=True)
    time.sleep(seconds)


@app.task(name="promoter_app.noop")
def noop():
    return "noop"
"""


def test_promoter_keeps_running_while_a_solo_worker_runs_a_long_task(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, key_prefix: str,
    keys: QueueKeys, app: Celery,
) -> None:
    """The reason for the thread: a long task in the solo pool does not stall promotion."""
    (tmp_path / "promoter_app.py").write_text(textwrap.dedent(WORKER_APP))
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_KEY_PREFIX": key_prefix}
    with CeleryWorker("promoter_app", pool="solo", env=env, pythonpath=[tmp_path],
                      queues=[QUEUE]) as worker:
        # The app adds the step itself and celery_ext adds it on worker_init: one promoter.
        channel = Settings(key_prefix=key_prefix).keys.wakeup_channel
        wait_for(lambda: subscribers(redis_client, channel) >= 1, message=worker.log_tail)
        assert subscribers(redis_client, channel) == 1
        app.send_task("promoter_app.sleep", args=[4], queue=QUEUE)
        worker.wait_for_log("sleep task started", timeout=20)
        busy_since = time.monotonic()
        app.send_task("promoter_app.noop", queue=QUEUE, countdown=0.5)
        assert redis_client.zcard(keys.delayed) == 1
        wait_for(lambda: redis_client.zcard(keys.delayed) == 0, timeout=3,
                 message=lambda: "not promoted during the long task:\n" + worker.log_tail())
        assert time.monotonic() - busy_since < 3.5  # the long task was still running
        assert "succeeded" not in worker.log_text().split("sleep task started", 1)[1]
        worker.wait_for_log(re.compile(r"promoter_app\.noop\[\S+\] succeeded"), timeout=20)


def test_real_worker_without_the_promoter_when_disabled(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, key_prefix: str,
    keys: QueueKeys, app: Celery,
) -> None:
    (tmp_path / "promoter_app.py").write_text(textwrap.dedent(WORKER_APP))
    env = {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_KEY_PREFIX": key_prefix,
           "TEST_PROMOTER": "0"}
    with CeleryWorker("promoter_app", pool="solo", env=env, pythonpath=[tmp_path],
                      queues=[QUEUE]) as worker:
        channel = Settings(key_prefix=key_prefix).keys.wakeup_channel
        assert subscribers(redis_client, channel) == 0
        # Due 1.5 s ahead (a slow publish must not find it due already); a second after it
        # is due, nothing has promoted it
        app.send_task("promoter_app.noop", queue=QUEUE,
                      eta=datetime.now(timezone.utc) + timedelta(seconds=1.5))
        time.sleep(2.5)
        assert redis_client.zcard(keys.delayed) == 1
        assert "promoter_app.noop[" not in worker.log_text()
