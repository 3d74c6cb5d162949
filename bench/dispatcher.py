"""Scenario ``dispatcher``: the HTTP API against publishing through the Python SDK.

Single ``POST /tasks`` at a fixed rate (p50/p99 of each request's round trip) and
``POST /tasks:batch`` of 1,000 tasks (tasks/s), each next to the same work done with
:class:`~kombu_envelope.Publisher` in the same run: ``publish`` at the same rate and
``publish_many`` of 1,000. Batches are posted to one dispatcher process on one connection,
and to ``--workers`` processes on several connections at once (what a deployment serving
many clients runs, and what the target is measured on).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from time import perf_counter

from bench.core import ENVELOPE, Context, ScenarioResult, new_run_id, paced
from bench.kombu_level import new_envelope
from bench.payload import PAYLOAD, TASK_TYPE
from bench.stats import percentile
from kombu_envelope import Publisher, Settings
from kombu_envelope.testing.dispatcher import DispatcherProcess

#: Tasks per batch.
BATCH = 1000
#: Goals of issue 12: single POST p99 (ms) at 500 requests/s, batch tasks/s.
P99_TARGET_MS = 5.0
BATCH_TARGET = 20_000


def _announce(ctx: Context, queue: str) -> None:
    """A worker serving the bench task on ``queue``: the dispatcher refuses unserved tasks."""
    # Imported here so that the other scenarios run where the store lacks announcements.
    from kombu_envelope.store.announcements import Announcements, WorkerAnnouncement

    client = ctx.client()
    now = datetime.now(timezone.utc)
    Announcements(client, Settings()).announce(WorkerAnnouncement(
        consumer=f"bench-{new_run_id()}", language="python", host="bench", pid=1,
        queues=[queue], serves={TASK_TYPE: []}, concurrency=1, started_at=now, seen_at=now,
        stopped_at=None, live=True))
    client.close()


def _paced(rate: float, seconds: float, send: Callable[[], None]) -> list[float]:
    """Call ``send`` ``rate`` times a second for ``seconds``; each call's time in ms."""
    latencies = []
    for _ in paced(rate, int(rate * seconds)):
        began = perf_counter()
        send()
        latencies.append((perf_counter() - began) * 1000)
    return latencies


def _poster(port: int, path: str, body: bytes, status: int) -> Callable[[], None]:
    """A function that POSTs ``body`` on one kept-alive connection and checks the status."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"Content-Type": "application/json"}

    def post() -> None:
        connection.request("POST", path, body, headers)
        answer = connection.getresponse()
        text = answer.read()
        assert answer.status == status, text

    return post


def _batches_at_once(port: int, path: str, body: bytes, connections: int,
                     batches: int) -> float:
    """Tasks/s of ``batches`` batches posted on each of ``connections`` connections at once."""
    posters = [_poster(port, path, body, 200) for _ in range(connections)]
    for post in posters:
        post()  # connected and warm

    def post_all(post: Callable[[], None]) -> None:
        for _ in range(batches):
            post()

    threads = [threading.Thread(target=post_all, args=(post,)) for post in posters]
    started = perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return connections * batches * BATCH / (perf_counter() - started)


def _repetition(ctx: Context, port: int, workers_port: int, sizes: dict[str, float]
                ) -> dict[str, float]:
    """One repetition on a fresh queue: every figure, by measure label."""
    rate, seconds, batches = sizes["rate"], sizes["seconds"], int(sizes["batches"])
    queue = f"bench.dispatcher.{new_run_id()}"
    _announce(ctx, queue)
    body = json.dumps({"task_type": TASK_TYPE, "payload": PAYLOAD}).encode()
    batch_body = json.dumps(
        {"tasks": [{"task_type": TASK_TYPE, "payload": PAYLOAD}] * BATCH}).encode()
    client = ctx.client()
    publisher = Publisher(client, Settings())
    figures: dict[str, float] = {}
    try:
        def publish() -> None:
            publisher.publish(queue, new_envelope())

        post = _poster(port, f"/tasks?queue={queue}", body, 201)
        for who, send in (("POST /tasks", post), ("Publisher.publish", publish)):
            send()  # warm up the connection
            latencies = _paced(rate, seconds, send)
            for pct in (50, 99):
                figures[f"single {who} p{pct}"] = percentile(latencies, pct)
        path = f"/tasks:batch?queue={queue}"
        figures[f"batch of {BATCH}, POST /tasks:batch"] = _batches_at_once(
            port, path, batch_body, 1, batches)
        figures[_workers_label(sizes)] = _batches_at_once(
            workers_port, path, batch_body, int(sizes["connections"]), batches)
        started = perf_counter()
        for _ in range(batches):
            publisher.publish_many([(queue, new_envelope()) for _ in range(BATCH)])
        figures[f"batch of {BATCH}, Publisher.publish_many"] = (
            batches * BATCH / (perf_counter() - started))
    finally:
        client.close()
        ctx.flush()
    return figures


def _workers_label(sizes: dict[str, float]) -> str:
    return (f"batch of {BATCH}, POST /tasks:batch, {sizes['workers']:.0f} processes, "
            f"{sizes['connections']:.0f} connections")


def run_dispatcher(ctx: Context, result: ScenarioResult) -> None:
    """Single POSTs at a fixed rate and batches, against the SDK doing the same."""
    sizes = {name: ctx.real("dispatcher", name)
             for name in ("rate", "seconds", "batches", "workers", "connections")}
    result.params.update(rate_per_s=sizes["rate"], seconds=sizes["seconds"], batch=BATCH,
                         batches=int(sizes["batches"]), workers=int(sizes["workers"]),
                         connections=int(sizes["connections"]))
    measures = {}
    for who in ("POST /tasks", "Publisher.publish"):
        for pct in ("p50", "p99"):
            label = f"single {who} {pct}"
            measures[label] = result.measure(label, ENVELOPE, "ms", higher_is_better=False)
    for label in (f"batch of {BATCH}, POST /tasks:batch", _workers_label(sizes),
                  f"batch of {BATCH}, Publisher.publish_many"):
        measures[label] = result.measure(label, ENVELOPE, "tasks/s")
    unlimited = ["--rate", "1000000", "--burst", "1000000", "--batch-max", str(BATCH)]
    with DispatcherProcess(ctx.redis_url, extra_args=unlimited) as server, DispatcherProcess(
            ctx.redis_url, extra_args=[*unlimited, "--workers", f"{sizes['workers']:.0f}"]
            ) as workers:
        for rep in range(ctx.repeat):
            figures = _repetition(ctx, server.port, workers.port, sizes)
            for label, value in figures.items():
                measures[label].add(value)
            ctx.log(f"dispatcher rep {rep + 1}: " + ", ".join(
                f"{label} {value:,.2f}" for label, value in figures.items()))
    result.ratio("single p99: POST /tasks / Publisher.publish",
                 measures["single POST /tasks p99"], measures["single Publisher.publish p99"])
    result.ratio(f"batch of {BATCH}: POST /tasks:batch / publish_many",
                 measures[f"batch of {BATCH}, POST /tasks:batch"],
                 measures[f"batch of {BATCH}, Publisher.publish_many"])
    result.target(f"single POST /tasks p99 <= {P99_TARGET_MS} ms at {sizes['rate']:.0f}/s",
                  measures["single POST /tasks p99"], P99_TARGET_MS, at_least=False, unit="ms")
    result.target(f"POST /tasks:batch >= {BATCH_TARGET:,} tasks/s "
                  f"({sizes['workers']:.0f} processes)",
                  measures[_workers_label(sizes)], BATCH_TARGET, unit="tasks/s")
    result.notes.append(
        "Single posts: one dispatcher process (uvicorn with uvloop and h11, no token) and "
        "one HTTP client (http.client) with a kept-alive connection, on the same machine as "
        "Redis; each request's round trip is timed from send to read answer. Batches: the "
        "same process on one connection, then a dispatcher run with --workers on several "
        "connections at once (one client thread each), each batch of 1,000 posted whole. "
        "The SDK figures come from one thread of the bench process, the same queue and the "
        "same Redis, right after.")
