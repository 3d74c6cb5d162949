"""Validate the CeleryWorker harness with the stock redis:// transport."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest
from apps.stock_app import create_app
from celery import Celery
from support import WaitTimeoutError, wait_for
from support.workers import CeleryWorker


@pytest.fixture
def stock_client(redis_url: str, key_prefix: str) -> Iterator[Celery]:
    app = create_app(broker_url=redis_url, key_prefix=key_prefix, queue=f"{key_prefix}-q")
    try:
        yield app
    finally:
        app.close()


def _worker_env(redis_url: str, key_prefix: str) -> dict[str, str]:
    return {
        "TEST_BROKER_URL": redis_url,
        "TEST_KEY_PREFIX": key_prefix,
        "TEST_QUEUE": f"{key_prefix}-q",
    }


def test_wait_for_returns_value_and_times_out() -> None:
    calls: list[int] = []

    def third_time() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert wait_for(third_time, timeout=5, interval=0.001) == 3
    with pytest.raises(WaitTimeoutError, match="never"):
        wait_for(lambda: False, timeout=0.05, message=lambda: "never")


def test_solo_worker_runs_task(stock_client: Celery, redis_url: str, key_prefix: str) -> None:
    with CeleryWorker("apps.stock_app", pool="solo", env=_worker_env(redis_url, key_prefix)) as w:
        assert w.is_alive()
        add = stock_client.tasks["stock_app.add"]
        result = add.delay(2, 3)
        assert result.get(timeout=20) == 5
        result.forget()
        wait_for(lambda: "succeeded" in w.log_text(), timeout=10, message=w.log_tail)
        assert w.hostname in w.log_text()
    assert not w.is_alive()
    assert w.returncode == 0


@pytest.mark.slow
def test_prefork_worker_kill_takes_children(redis_url: str, key_prefix: str) -> None:
    worker = CeleryWorker(
        "apps.stock_app",
        pool="prefork",
        concurrency=2,
        env=_worker_env(redis_url, key_prefix),
    )
    with worker:
        children = worker.children()
        assert len(children) >= 2
        worker.kill()
        assert not worker.is_alive()
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
    assert worker.returncode == -9
