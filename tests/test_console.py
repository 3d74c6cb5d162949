"""The operators' console (``/console/``) end to end, in headless Chromium.

A Go worker dead-letters a task whose payload it refuses; an operator signs in, finds it
on the dead letters page, sees the registered schema's 422 for a wrong fix, fixes the
payload, replays it, and a Node.js worker runs it (its effect is checked in Redis). A
read-only token sees no replay, purge or cancel, and the server refuses them (403).
Screenshots of each page go to the test's tmp dir (the path is printed).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from playwright.sync_api import Browser, Page, expect, sync_playwright
from support import wait_for
from support.peers import GO, GoPeer, NodePeer, build_go_peer, node_unavailable

from kombu_envelope import Envelope, Publisher, Settings
from kombu_envelope.envelope import utcnow
from kombu_envelope.failures import Failure, FailureClass
from kombu_envelope.keys import Bucket
from kombu_envelope.store.dead_letters import DeadLetters, dead_letter_envelope
from kombu_envelope.testing.dispatcher import DispatcherProcess

READ, OPERATOR = ("r-" + "a" * 30, "o-" + "c" * 30)
TOKENS = [{"name": "reader", "scope": "read", "token": READ},
          {"name": "ops", "scope": "operator", "token": OPERATOR}]
PREFIX = f"t-console-{uuid.uuid4().hex[:8]}"
#: Debian's chromium (.ci/run installs it); Playwright's own browsers are not used.
CHROMIUM = shutil.which("chromium")
#: A payload schema the operator's first fix breaks (``minLength``).
ORDER_SCHEMA = {"type": "object", "required": ["order_id"],
                "properties": {"order_id": {"type": "string", "minLength": 3}}}

_NODE_UNAVAILABLE = node_unavailable()
pytestmark = [
    pytest.mark.skipif(GO is None, reason="the Go toolchain (`go`) is not on PATH"),
    pytest.mark.skipif(_NODE_UNAVAILABLE is not None, reason=_NODE_UNAVAILABLE or ""),
]


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[DispatcherProcess]:
    with DispatcherProcess(redis_url, TOKENS, {"key_prefix": PREFIX}) as proc:
        yield proc


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM is not None, "chromium is not on PATH (apt-get install chromium)"
    with sync_playwright() as playwright:
        found = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield found
        found.close()


@pytest.fixture
def store(redis_url: str) -> Iterator[tuple[redis.Redis, Settings]]:
    client = redis.Redis.from_url(redis_url)
    yield client, Settings(key_prefix=PREFIX)
    client.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Iterator[Any]:
    folder = tmp_path / "screenshots"
    folder.mkdir()

    def shot(page: Page, name: str) -> None:
        page.screenshot(path=str(folder / f"{name}.png"), full_page=True)

    yield shot
    print(f"console screenshots: {folder}")


def sign_in(browser: Browser, server: DispatcherProcess, secret: str, who: str) -> Page:
    page = browser.new_page()
    page.goto(server.url + "/console/")
    page.get_by_label("Bearer token").fill(secret)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#who")).to_have_text(who)
    return page


def test_console_pages_are_static_files_under_a_policy_without_inline_scripts(
        server: DispatcherProcess) -> None:
    page = httpx.get(server.url + "/console/")
    policy = page.headers["content-security-policy"]
    assert page.status_code == 200 and "<script type=\"module\" src=\"main.js\">" in page.text
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert httpx.get(server.url + "/console/main.js").headers["content-type"].startswith(
        "text/javascript")
    assert httpx.get(server.url + "/healthz").headers["content-security-policy"] == (
        "default-src 'none'; frame-ancestors 'none'")
    assert httpx.get(server.url + "/whoami").status_code == 401
    assert httpx.get(server.url + "/whoami", headers={"Authorization": f"Bearer {READ}"}).json() \
        == {"name": "reader", "scope": "read", "authenticated": True}


SCRAPES = ["""# TYPE kombu_envelope_tasks_succeeded_total counter
kombu_envelope_tasks_succeeded_total{queue="a",task_type="t",language="go"} 4
kombu_envelope_tasks_succeeded_total{queue="a",task_type="t",language="node"} 6
kombu_envelope_tasks_succeeded_total{queue="b \\"x\\"",task_type="t",language="go"} 7
kombu_envelope_queue_backlog_entries{queue="a",bucket="normal",group="g"} 3
""", """kombu_envelope_tasks_succeeded_total{queue="a",task_type="t",language="go"} 14
kombu_envelope_tasks_succeeded_total{queue="a",task_type="t",language="node"} 16
kombu_envelope_tasks_succeeded_total{queue="b \\"x\\"",task_type="t",language="go"} 2
"""]


def test_overview_sums_scrapes_per_queue_and_rates_counters_between_two(
        browser: Browser, server: DispatcherProcess) -> None:
    page = browser.new_page()
    page.goto(server.url + "/console/")
    found = page.evaluate("""async ([before, after]) => {
        const m = await import('./metrics.js');
        const name = 'kombu_envelope_tasks_succeeded_total';
        const sums = [before, after].map((text) => m.sumBy(m.parseMetrics(text), name, 'queue'));
        return [[...sums[0]], [...m.rates(sums[0], sums[1], 10)],
                m.parseMetrics(before).at(-1)];
    }""", SCRAPES)
    page.close()
    assert found == [
        [["a", 10], ['b "x"', 7]],
        [["a", 2], ['b "x"', 0.2]],  # a counter that went down restarted from 0
        {"name": "kombu_envelope_queue_backlog_entries", "value": 3,
         "labels": {"queue": "a", "bucket": "normal", "group": "g"}}]


def test_operator_fixes_a_go_dead_letter_and_a_node_worker_runs_it(
        browser: Browser, server: DispatcherProcess, store: tuple[redis.Redis, Settings],
        redis_url: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
        screenshots: Any) -> None:
    client, settings = store
    queue = f"console-{uuid.uuid4().hex[:6]}"
    go = GoPeer(build_go_peer(tmp_path_factory), redis_url, PREFIX, queue, tmp_path)
    node = NodePeer(redis_url, PREFIX, tmp_path)
    try:
        go_worker = go.worker()
        [task_id] = go.produce("--task-type", "order.close_timeout",
                               "--payload", '{"order": "o-42"}')  # no order_id: refused
        [later_id] = go.produce("--task-type", "order.close_timeout",
                                "--payload", '{"order_id": "later"}', "--delay-ms", "600000")
        dead = wait_for(lambda: DeadLetters(client, settings).list([queue]), timeout=15,
                        message=go_worker.log_tail)
        go_worker.stop()
        assert dead[0].fields["language"] == "go" and dead[0].task_id == task_id
        ops = {"Authorization": f"Bearer {OPERATOR}"}
        assert httpx.post(f"{server.url}/schemas/order.close_timeout/1", json=ORDER_SCHEMA,
                          headers=ops).status_code == 200
        node.worker(queue, "--lease-ms", "1500", "--block-ms", "200")

        page = sign_in(browser, server, OPERATOR, "ops (operator)")
        queues = page.get_by_role("table", name="Queues")
        expect(queues.get_by_role("row").filter(has_text=queue)).to_contain_text(
            [f"{queue}\t0\t0\t1\t1"], use_inner_text=True)  # backlog, pending, delayed, dead
        page.get_by_role("link", name="Dead letters").click()
        stats = page.get_by_role("table", name="Dead letters per queue, task type and "
                                               "failure class")
        expect(stats.get_by_role("row").filter(has_text=queue)).to_contain_text(
            ["order.close_timeout\tinvalid_payload\t1"], use_inner_text=True)
        screenshots(page, "dead-letters")
        page.get_by_role("button", name=f"Open dead letter {dead[0].entry_id}").click()
        detail = page.get_by_role("region", name=f"Dead letter {dead[0].entry_id}")
        expect(detail.locator("pre.envelope")).to_contain_text(task_id)
        expect(detail).to_contain_text("order_id")  # the Go handler's reason
        expect(detail.locator("pre.trace")).to_be_visible()
        expect(detail).to_contain_text("Payload schema of order.close_timeout version 1")
        payload = page.get_by_label("Payload (JSON object)")
        payload.fill('{"order_id": ')
        expect(page.locator("#dl-payload-feedback")).to_contain_text("JSON syntax")
        expect(payload).to_have_attribute("aria-invalid", "true")
        payload.fill('{"order_id": "o"}')
        expect(page.locator("#dl-payload-feedback")).to_have_text("Valid JSON.")
        page.get_by_role("button", name="Check").click()
        outcome = detail.get_by_role("status")
        expect(outcome).to_contain_text("422 invalid")
        expect(outcome).to_contain_text("payload.order_id")
        screenshots(page, "dead-letter-422")
        payload.fill('{"order_id": "o-42"}')
        page.get_by_role("button", name="Check").click()
        expect(outcome).to_contain_text("passes every rule")
        page.get_by_role("button", name="Replay", exact=True).click()
        expect(outcome).to_contain_text("Replayed as stream entry")
        effect = f"{PREFIX}:effects:order.close_timeout:o-42"
        wait_for(lambda: client.get(effect) == b"1", timeout=15,
                 message=lambda: node.workers[0].log_tail())
        assert f"node:{task_id}".encode() in client.lrange(f"{PREFIX}:effects:log", 0, -1)
        assert DeadLetters(client, settings).list([queue]) == []
        screenshots(page, "replayed")

        page.get_by_role("link", name="Overview").click()
        row = page.get_by_role("table", name="Queues").get_by_role("row").filter(has_text=queue)
        expect(row).to_contain_text([f"{queue}\t0\t0\t1\t0\t"], use_inner_text=True)
        expect(row).to_contain_text("/s", timeout=15_000)  # a rate: two scrapes seen
        workers = page.get_by_role("table", name="Workers by language")
        expect(workers.get_by_role("row").filter(has_text="live")).to_contain_text(
            ["node\t"], use_inner_text=True)
        expect(workers).to_contain_text("order.close_timeout (v1)")
        screenshots(page, "overview")

        page.get_by_role("link", name="Delayed").click()
        page.get_by_role("button", name=f"Show delayed tasks of {queue}").click()
        cancel = page.get_by_role("button", name=f"Cancel {later_id}")
        cancel.click()
        dialog = page.get_by_role("dialog", name="Cancel a delayed task")
        expect(dialog).to_be_visible()
        expect(dialog.get_by_role("button", name="Cancel", exact=True)).to_be_focused()
        page.keyboard.press("Escape")
        expect(dialog).to_be_hidden()
        expect(cancel).to_be_focused()
        screenshots(page, "delayed")
        cancel.click()
        dialog.get_by_role("button", name="Cancel task").click()
        expect(page.get_by_role("status").first).to_contain_text(f"Task {later_id}: removed.")
        assert client.zcard(settings.keys.queue(queue).delayed) == 0
    finally:
        go.close()
        node.close()


def test_a_read_only_token_sees_no_replay_purge_or_cancel_and_is_refused(
        browser: Browser, server: DispatcherProcess, store: tuple[redis.Redis, Settings],
        screenshots: Any) -> None:
    client, settings = store
    queue = f"console-{uuid.uuid4().hex[:6]}"
    envelope = Envelope.new(task_type="bill.charge", payload={"n": 1})
    entry_id = dead_letter_envelope(
        client, settings, queue=queue, envelope=envelope, consumer="c1",
        failure=Failure(FailureClass.TASK_ERROR, "boom", task_id=envelope.task_id,
                        task_type="bill.charge", traceback="Traceback: boom"))
    stranger = browser.new_page()
    stranger.goto(server.url + "/console/")
    stranger.get_by_label("Bearer token").fill("x" * 20)
    stranger.keyboard.press("Enter")
    expect(stranger.locator("#sign-in-error")).to_have_text(
        "401 unauthorized: the bearer token is not known")
    expect(stranger.get_by_role("navigation")).to_be_hidden()
    stranger.close()
    page = sign_in(browser, server, READ, "reader (read)")
    page.get_by_role("link", name="Dead letters").click()
    page.get_by_label("Queue").fill(queue)
    page.get_by_role("button", name="Apply").click()
    page.get_by_role("button", name=f"Open dead letter {entry_id}").click()
    detail = page.get_by_role("region", name=f"Dead letter {entry_id}")
    expect(detail.locator("pre.trace")).to_have_text("Traceback: boom")
    expect(detail.locator("pre.envelope")).to_contain_text(envelope.task_id)
    for name in ("Replay", "Replay selected", "Purge…", "Check"):
        expect(page.get_by_role("button", name=name, exact=True)).to_have_count(0)
    expect(page.get_by_role("checkbox")).to_have_count(0)
    screenshots(page, "read-only-dead-letter")
    later = Envelope.new(task_type="report.build", schedule_time=utcnow() + timedelta(hours=1))
    Publisher(client, settings).publish(queue, later)
    page.get_by_role("link", name="Delayed").click()
    page.get_by_role("button", name=f"Show delayed tasks of {queue}").click()
    expect(page.get_by_role("table", name="1 tasks")).to_contain_text(later.task_id)
    expect(page.get_by_role("button", name=f"Cancel {later.task_id}")).to_have_count(0)
    page.close()

    reader = {"Authorization": f"Bearer {READ}"}
    replay = httpx.post(f"{server.url}/dead-letters/{queue}/{entry_id}/replay", json={},
                        headers=reader)
    assert replay.status_code == 403 and "scope operator" in replay.json()["message"]
    assert httpx.delete(f"{server.url}/dead-letters/{queue}", headers=reader).status_code == 403
    assert httpx.post(f"{server.url}/delayed/{queue}/{later.task_id}/cancel",
                      headers=reader).status_code == 403
    assert [e.entry_id for e in DeadLetters(client, settings).list([queue])] == [entry_id]


def test_operator_replays_a_selection_and_purges_after_confirming(
        browser: Browser, server: DispatcherProcess, store: tuple[redis.Redis, Settings],
        screenshots: Any) -> None:
    client, settings = store
    queue = f"console-{uuid.uuid4().hex[:6]}"
    ids = []
    for number in range(3):
        envelope = Envelope.new(task_type="bill.charge", payload={"n": number})
        ids.append(dead_letter_envelope(
            client, settings, queue=queue, envelope=envelope, consumer="c1",
            failure=Failure(FailureClass.TASK_ERROR, "boom", task_id=envelope.task_id,
                            task_type="bill.charge")))
    page = sign_in(browser, server, OPERATOR, "ops (operator)")
    page.get_by_role("link", name="Dead letters").click()
    page.get_by_label("Queue").fill(queue)
    page.keyboard.press("Enter")
    page.get_by_role("checkbox", name=f"Select {ids[0]}").check()
    page.get_by_role("button", name="Replay selected").click()
    expect(page.get_by_text("Replayed 1 entries.")).to_be_visible()
    assert client.xlen(settings.keys.queue(queue).stream(Bucket.NORMAL)) == 1
    page.get_by_role("button", name="Purge…").click()
    dialog = page.get_by_role("dialog", name="Purge dead letters")
    expect(dialog).to_contain_text(f"Delete 2 dead letter(s) matching the filters from {queue}")
    screenshots(page, "purge-dialog")
    dialog.get_by_role("button", name="Cancel").click()
    expect(page.get_by_text("Nothing was purged.")).to_be_visible()
    page.get_by_role("button", name="Purge…").click()
    dialog.get_by_role("button", name="Purge").click()
    expect(page.get_by_text("Purged 2 entries.")).to_be_visible()
    assert DeadLetters(client, settings).list([queue]) == []
    page.close()


def test_without_tokens_there_is_no_sign_in(browser: Browser, redis_url: str) -> None:
    with DispatcherProcess(redis_url, options={"key_prefix": PREFIX}) as loopback:
        page = browser.new_page()
        page.goto(loopback.url + "/console/#delayed")
        expect(page.locator("#who")).to_have_text("no tokens configured (loopback only)")
        expect(page.get_by_role("heading", name="Delayed tasks")).to_be_visible()
        expect(page.get_by_label("Bearer token")).to_be_hidden()
        expect(page.get_by_role("button", name="Sign out")).to_be_hidden()
        page.close()
