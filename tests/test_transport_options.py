"""Transport options and the Celery boundary, through real Redis, kombu and Celery workers.

A Celery app that imports ``kombu_envelope`` instead of ``celery_ext`` (apps/kombu_only_app.py)
must fail at once naming the fix, never store its tasks as plain kombu messages; a bad
option must stop a worker at start naming it; and the keys kombu and Celery add to the
transport options by themselves must never stop anything. This test process has imported
``celery_ext``, so each case without it runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import kombu
import pytest
import redis
from apps.kombu_only_app import create_app
from kombu import Queue
from support.envelope_streams import envelope_url
from support.workers import PROJECT_ROOT, TESTS_DIR, CeleryWorker

import celery_ext  # noqa: F401  (this process publishes what the workers run)
from kombu_envelope import Envelope
from kombu_envelope.errors import CeleryExtensionMissing, InvalidTransportOption

APP = "apps.kombu_only_app"
#: The plain adapter, named: what a kombu user sets once celery_ext took over envelope://.
ADAPTER = "kombu_envelope.kombu.adapter:MessageAdapter"
PLAIN_TRANSPORT = "kombu_envelope.kombu.transport:Transport"
RESULT_TIMEOUT = 20
FIX = "add `import celery_ext` to the module that creates the Celery app"
#: Celery's default task_publish_retry_policy, which kombu copies into the options.
RETRY_POLICY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.2,
                "interval_max": 1}


def run_python(code: str, **values: Any) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (its ``{name}`` fields filled with ``values``) in a new interpreter."""
    source = textwrap.dedent(code).format(**{k: repr(v) for k, v in values.items()})
    env = {"PYTHONPATH": f"{TESTS_DIR}:{PROJECT_ROOT}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", source], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    return sorted(client.scan_iter(match=f"{prefix}:*"))


def worker_env(redis_url: str, prefix: str, **options: Any) -> dict[str, str]:
    return {"TEST_BROKER_URL": envelope_url(redis_url), "TEST_RESULT_BACKEND": redis_url,
            "TEST_KEY_PREFIX": prefix, "TEST_TRANSPORT_OPTIONS": json.dumps(options)}


def plain_connection(redis_url: str, prefix: str, **kwargs: Any) -> kombu.Connection:
    return kombu.Connection(envelope_url(redis_url), transport=PLAIN_TRANSPORT,
                            transport_options={"key_prefix": prefix,
                                               "message_adapter": ADAPTER}, **kwargs)


# ------------------------------------------------- Celery without celery_ext


def test_a_celery_app_importing_only_kombu_envelope_fails_its_first_task_naming_the_fix(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    done = run_python("""
        import sys
        from apps.kombu_only_app import create_app
        app = create_app({broker}, {backend}, {prefix})
        try:
            app.tasks["kombu_only_app.add"].delay(2, 3)
        except Exception as exc:
            print(f"{{type(exc).__name__}}: {{exc}}")
        print("celery_ext imported:", "celery_ext" in sys.modules)
    """, broker=envelope_url(redis_url), backend=redis_url, prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CeleryExtensionMissing: Celery is loaded but celery_ext "
                                  "is not"), done.stdout
    assert FIX in done.stdout
    assert "celery_ext imported: False" in done.stdout
    assert keys_under(redis_client, key_prefix) == []


def test_celerys_test_worker_for_that_app_fails_at_once_naming_the_fix(
    redis_url: str, key_prefix: str
) -> None:
    """``start_worker`` (behind the ``celery_worker`` fixture) runs no command line, so
    nothing imports celery_ext for it."""
    done = run_python("""
        import time
        import celery.contrib.testing.tasks  # the ping task start_worker checks
        from celery.contrib.testing.worker import start_worker
        from apps.kombu_only_app import create_app
        app = create_app({broker}, {backend}, {prefix})
        started = time.monotonic()
        try:
            with start_worker(app, pool="solo"):
                print("the worker started")
        except Exception as exc:
            print(f"{{type(exc).__name__}} after {{time.monotonic() - started:.1f}} s: {{exc}}")
    """, broker=envelope_url(redis_url), backend=redis_url, prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CeleryExtensionMissing after "), done.stdout + done.stderr
    assert FIX in done.stdout
    assert float(done.stdout.split()[2]) < 10


def test_the_celery_worker_command_for_that_app_runs_its_tasks(
    redis_url: str, key_prefix: str
) -> None:
    """The command line imports celery_ext through its plugin entry point. Gossip and
    heartbeat on, as Celery's defaults: they publish with retry policies, which kombu
    copies into the transport options of the worker's connections."""
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, {})
    try:
        with CeleryWorker(APP, env=worker_env(redis_url, key_prefix), gossip=True,
                          heartbeat=True) as worker:
            results = [app.tasks["kombu_only_app.add"].delay(i, 1) for i in range(3)]
            assert [r.get(timeout=RESULT_TIMEOUT) for r in results] == [1, 2, 3]
            assert "Connected to envelope://" in worker.log_text()
            time.sleep(2.5)  # a heartbeat (every 2 s) was published: still running
            assert worker.is_alive(), worker.log_tail()
    finally:
        app.close()


def test_the_plain_adapter_refuses_a_celery_task_message_and_stores_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Even with an adapter named (which skips the check for a loaded Celery)."""
    with plain_connection(redis_url, key_prefix) as conn:
        producer = conn.Producer()
        with pytest.raises(CeleryExtensionMissing, match=r"Celery task 'proj\.add' refused"):
            producer.publish([[2, 3], {}, {}], serializer="json", routing_key="celery",
                             declare=[Queue("celery")],
                             headers={"lang": "py", "task": "proj.add",
                                      "id": str(uuid.uuid4())})
    streams = [k for k in keys_under(redis_client, key_prefix)
               if redis_client.type(k) == b"stream"]
    assert [redis_client.xlen(k) for k in streams] == [0] * len(streams)


def test_a_process_that_loads_celery_uses_plain_kombu_once_it_names_the_adapter(
    redis_url: str, key_prefix: str
) -> None:
    done = run_python("""
        import sys, celery, kombu
        from kombu import Queue
        import kombu_envelope
        from kombu_envelope import Envelope
        from kombu_envelope.errors import CeleryExtensionMissing
        url, prefix = {broker}, {prefix}
        try:
            kombu.Connection(url, transport_options={{"key_prefix": prefix}}).connect()
        except CeleryExtensionMissing:
            print("refused without an adapter")
        options = {{"key_prefix": prefix, "message_adapter": {adapter}}}
        with kombu.Connection(url, transport_options=options) as conn:
            task = Envelope.new(task_type="orders.close", payload={{"order_id": 7}})
            conn.Producer().publish(task, serializer="envelope", routing_key="orders",
                                    declare=[Queue("orders")])
            with conn.SimpleQueue("orders") as queue:
                message = queue.get(timeout=10)
                message.ack()
                print("delivered", message.payload["task_id"] == task.task_id)
        print("celery_ext imported:", "celery_ext" in sys.modules)
    """, broker=envelope_url(redis_url), prefix=key_prefix, adapter=ADAPTER)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["refused without an adapter", "delivered True",
                                        "celery_ext imported: False"], done.stdout


def test_kombu_envelope_never_imports_celery(redis_url: str, key_prefix: str) -> None:
    done = run_python("""
        import importlib, pkgutil, sys
        import kombu
        from kombu import Queue
        import django.conf, django
        import kombu_envelope
        from kombu_envelope import Envelope
        # The outbox's Django app has models: importing them needs Django set up.
        django.conf.settings.configure(INSTALLED_APPS=["kombu_envelope.outbox.django"])
        django.setup()
        for module in pkgutil.walk_packages(kombu_envelope.__path__, "kombu_envelope."):
            importlib.import_module(module.name)
        with kombu.Connection({broker}, transport_options={{"key_prefix": {prefix}}}) as conn:
            task = Envelope.new(task_type="orders.close", payload={{"order_id": 7}})
            conn.Producer().publish(task, serializer="envelope", routing_key="orders",
                                    declare=[Queue("orders")])
            with conn.SimpleQueue("orders") as queue:
                queue.get(timeout=10).ack()
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "celery_ext")))
    """, broker=envelope_url(redis_url), prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------- bad options


@pytest.mark.parametrize(("options", "said"), [
    ({"lease_sm": 5000}, "'lease_sm': unknown option (did you mean 'lease_ms'?)"),
    ({"visibility_timeout": 43_200}, "'visibility_timeout': kombu's redis:// option"),
    ({"lease_ms": "5000"}, "'lease_ms': must be an integer, not '5000'"),
], ids=["misspelt", "stock", "wrong-type"])
def test_a_celery_worker_with_a_bad_option_exits_at_start_naming_it(
    redis_url: str, key_prefix: str, options: dict[str, Any], said: str
) -> None:
    worker = CeleryWorker(APP, env=worker_env(redis_url, key_prefix, **options))
    try:
        worker.start(wait_ready=False)
        deadline = time.monotonic() + 30
        while worker.returncode is None:
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)
        assert worker.returncode != 0
        log = worker.log_text()
        assert f"InvalidTransportOption: transport option {said}" in log, log[-3000:]
        assert " ready." not in log
    finally:
        worker.close()


def test_a_producer_with_a_misspelt_option_fails_its_first_publish_and_stores_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = create_app(envelope_url(redis_url), redis_url, key_prefix, {"blok_ms": 500})
    try:
        with pytest.raises(InvalidTransportOption) as excinfo:
            app.tasks["kombu_only_app.add"].delay(2, 3)
    finally:
        app.close()
    assert excinfo.value.options == ["blok_ms"]
    assert "did you mean 'block_ms'?" in str(excinfo.value)
    assert keys_under(redis_client, key_prefix) == []


def test_the_retry_policy_kombu_copies_into_the_options_never_breaks_a_new_connection(
    redis_url: str, key_prefix: str
) -> None:
    """Producer.publish(retry=True) adds its policy to the connection's transport
    options; a clone (as Celery's pools make) builds a transport from them."""
    with plain_connection(redis_url, key_prefix) as conn:
        task = Envelope.new(task_type="orders.close", payload={"order_id": 7})
        conn.Producer().publish(task, serializer="envelope", routing_key="orders",
                                declare=[Queue("orders")], retry=True,
                                retry_policy=dict(RETRY_POLICY))
        assert set(RETRY_POLICY) <= set(conn.transport_options)
        with conn.clone() as clone:
            assert clone.transport_options == conn.transport_options
            with clone.SimpleQueue("orders") as queue:
                message = queue.get(timeout=10)
                message.ack()
    assert message.payload["task_id"] == task.task_id
