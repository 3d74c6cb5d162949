"""Celery app for the reliable-execution tests: plain ``@app.task`` code on ``envelope://``.

Configured from the environment when loaded by a worker (see ``envelope_app``):
``TEST_BROKER_URL``, ``TEST_RESULT_BACKEND`` (its Redis also holds the tasks'
counters), ``TEST_KEY_PREFIX``, ``TEST_LEASE_MS``, ``TEST_RETRY_POLICY`` (JSON
for ``envelope_retry_policy``; short delays by default) and ``TEST_ACKS_LATE``
(``0`` to acknowledge tasks when they start; late by default). Tasks record
what they did under ``<prefix>:probe:...`` keys.

A task called with the keyword ``pause_before_claim=<path>`` pauses once, in
``task_prerun`` (before the execution shell claims its key): it creates
``<path>.ready`` and waits until ``<path>.go`` exists, so a test can stop Redis
at that moment.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from typing import Any

import redis
from celery import Celery, Task, signals
from celery.exceptions import Reject

import celery_ext  # noqa: F401  (envelope:// URLs)
from celery_ext.failures import InvalidPayload

#: Retry policy of the tests unless TEST_RETRY_POLICY says otherwise: short delays.
DEFAULT_POLICY = {"fast_retries": 2, "backoff_s": 0.2, "max_backoff_s": 2.0}

_MAX_SCRIPT = """
local current = redis.call('INCR', KEYS[1])
local best = tonumber(redis.call('GET', KEYS[2]) or '0')
if current > best then redis.call('SET', KEYS[2], current) end
return current
"""


#: Task keyword of :func:`pause_before_claim`.
PAUSE_KEYWORD = "pause_before_claim"


@signals.task_prerun.connect(weak=False)
def pause_before_claim(kwargs: dict[str, Any] | None = None, **_: Any) -> None:
    """The first attempt of a task given ``pause_before_claim`` waits for ``<path>.go``."""
    path = (kwargs or {}).get(PAUSE_KEYWORD)
    if not path or os.path.exists(f"{path}.ready"):
        return
    open(f"{path}.ready", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{path}.go") and time.monotonic() < deadline:
        time.sleep(0.02)


def create_app(broker_url: str | None = None, result_backend: str | None = None,
               key_prefix: str | None = None, lease_ms: int | None = None) -> Celery:
    """Build the app; unset arguments fall back to the ``TEST_*`` env vars."""
    broker_url = broker_url or os.environ.get("TEST_BROKER_URL", "memory://")
    backend = result_backend or os.environ.get("TEST_RESULT_BACKEND") or "redis://"
    prefix = key_prefix or os.environ.get("TEST_KEY_PREFIX", "envelope")
    lease_ms = lease_ms or int(os.environ.get("TEST_LEASE_MS", "30000"))
    policy = json.loads(os.environ.get("TEST_RETRY_POLICY") or "null") or DEFAULT_POLICY

    app = Celery("reliable_app", broker=broker_url, backend=backend)
    app.conf.update(
        broker_transport_options={"key_prefix": prefix, "lease_ms": lease_ms},
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        broker_connection_retry_on_startup=True,
        result_expires=600,
        task_acks_late=os.environ.get("TEST_ACKS_LATE", "1") == "1",
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        envelope_retry_policy=policy,
        envelope_idempotency_defer=0.3,
    )

    @cache
    def probe() -> redis.Redis:
        return redis.Redis.from_url(backend)

    def key(*parts: Any) -> str:
        return ":".join([prefix, "probe", *map(str, parts)])

    def record_attempt(task: Task, name: str) -> int:
        """Note the attempt's time and headers; return how many attempts ran."""
        headers = task.request.headers or {}
        probe().rpush(key("attempts", name), json.dumps({
            "at": time.time(), "retries": task.request.retries,
            "fast": headers.get("x-fast-retries"), "first": headers.get("x-first-failure-at"),
        }))
        return int(probe().llen(key("attempts", name)))

    @app.task(name="reliable.effect", shared=False, idempotency_fields=("order_id",))
    def effect(order_id: str, hold: bool = False, pause_before_claim: str | None = None) -> int:
        """The business effect (INCR); waits while ``hold:<order_id>`` is set."""
        probe().incr(key("started", order_id))
        while hold and probe().exists(key("hold", order_id)):
            time.sleep(0.05)
        return int(probe().incr(key("effects", order_id)))

    @app.task(name="reliable.transient", shared=False, bind=True, max_retries=4,
              envelope_retry_policy={"backoff_s": 1.0, "max_backoff_s": 10.0})
    def transient(self: Task, name: str) -> None:
        record_attempt(self, name)
        raise ConnectionError(f"{name} cannot connect")

    @app.task(name="reliable.flaky", shared=False, bind=True, max_retries=5)
    def flaky(self: Task, name: str, failures: int) -> dict[str, Any]:
        """A plain raise ``failures`` times, then the request's retry state."""
        if record_attempt(self, name) <= failures:
            raise ConnectionError("flaky")
        return {"retries": self.request.retries,
                "fast": (self.request.headers or {}).get("x-fast-retries")}

    @app.task(name="reliable.explicit", shared=False, bind=True, max_retries=5,
              default_retry_delay=0.2)
    def explicit(self: Task, name: str, failures: int) -> dict[str, Any]:
        """``self.retry()`` ``failures`` times, then the request's retry state."""
        if record_attempt(self, name) <= failures:
            try:
                raise ConnectionError("explicit")
            except ConnectionError as exc:
                raise self.retry(exc=exc) from exc
        return {"retries": self.request.retries,
                "fast": (self.request.headers or {}).get("x-fast-retries")}

    @app.task(name="reliable.auto", shared=False, bind=True, max_retries=5,
              autoretry_for=(ConnectionError,), default_retry_delay=0.2)
    def auto(self: Task, name: str, failures: int) -> dict[str, Any]:
        """``autoretry_for`` ``failures`` times, then the request's retry state."""
        if record_attempt(self, name) <= failures:
            raise ConnectionError("auto")
        return {"retries": self.request.retries,
                "fast": (self.request.headers or {}).get("x-fast-retries")}

    @app.task(name="reliable.broken", shared=False, bind=True, max_retries=1)
    def broken(self: Task, name: str) -> None:
        record_attempt(self, name)
        raise ValueError(f"{name} is broken")

    @app.task(name="reliable.invalid", shared=False, bind=True)
    def invalid(self: Task, name: str, delay: float = 0) -> None:
        record_attempt(self, name)
        time.sleep(delay)
        raise InvalidPayload(f"{name} has no customer")

    @app.task(name="reliable.rejecting", shared=False, bind=True)
    def rejecting(self: Task, name: str) -> None:
        record_attempt(self, name)
        raise Reject(f"{name} is not for us", requeue=False)

    @app.task(name="reliable.slow", shared=False, bind=True, max_retries=1)
    def slow(self: Task, name: str, seconds: float, until_retry: int = 99) -> int:
        """Sleeps ``seconds`` on attempts before retry ``until_retry``."""
        record_attempt(self, name)
        if self.request.retries < until_retry:
            time.sleep(seconds)
        retries: int = self.request.retries
        return retries

    @app.task(name="reliable.capped", shared=False, bind=True, max_retries=3,
              envelope_retry_policy={"retry_concurrency": 2, "fast_retries": 0})
    def capped(self: Task, name: str, seconds: float) -> int:
        """Fails once; its retries count how many of them run at once."""
        if self.request.retries == 0:
            raise ValueError("first attempt fails")
        probe().eval(_MAX_SCRIPT, 2, key("running", name), key("max", name))
        try:
            time.sleep(seconds)
        finally:
            probe().decr(key("running", name))
        retries: int = self.request.retries
        return retries

    @app.task(name="reliable.retry_then_die", shared=False, bind=True, max_retries=3)
    def retry_then_die(self: Task, name: str) -> None:
        """Retries in an hour, then its process dies before the task returns."""
        record_attempt(self, name)
        self.retry(countdown=3600, throw=False)
        os._exit(1)

    @app.task(name="reliable.retry_after_hold", shared=False, bind=True, max_retries=3)
    def retry_after_hold(self: Task, name: str) -> None:
        """Waits while ``hold:<name>`` is set (``holding:<name>`` says it does), then
        retries in an hour."""
        record_attempt(self, name)
        probe().set(key("holding", name), 1)
        while probe().exists(key("hold", name)):
            time.sleep(0.05)
        raise self.retry(countdown=3600)

    @app.task(name="reliable.retry_then_fail", shared=False, bind=True, max_retries=1)
    def retry_then_fail(self: Task, name: str, countdown: float = 1.5) -> None:
        """Retries once ``countdown`` seconds later, then fails for good (dead-lettered)."""
        record_attempt(self, name)
        raise self.retry(exc=ValueError(f"{name} failed"), countdown=countdown)

    @app.task(name="reliable.versioned", shared=False, bind=True, payload_versions=(1, 2))
    def versioned(self: Task, amount: Any) -> str:
        if not isinstance(amount, int):
            raise InvalidPayload(f"amount {amount!r} is not an integer")
        version = getattr(self.request, "payload_version", 1)
        probe().set(key("versioned", self.request.id), f"{version}:{amount}")
        return f"{version}:{amount}"

    return app


app = create_app()
