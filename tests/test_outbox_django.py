"""The outbox's Django app: rows written inside ``transaction.atomic``, relayed through SQLAlchemy.

Django is configured once for this module (an in-test settings module on a SQLite file),
the migration creates the table, the relay reads it with SQLAlchemy, Redis is real.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import django
import pytest
import redis
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import transaction

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope
from kombu_envelope.keys import BUCKETS_BY_URGENCY
from kombu_envelope.outbox import Relay, outbox_engine
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher
from tests.support.celery_outbox import outbox_app

QUEUE = "outbox"


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("django") / "app.db"
    django_settings.configure(
        INSTALLED_APPS=["kombu_envelope.outbox.django"], USE_TZ=True,
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)}})
    django.setup()
    call_command("migrate", verbosity=0)
    yield path
    from django.db import connections

    connections.close_all()


@pytest.fixture
def settings(key_prefix: str) -> Settings:
    return Settings(key_prefix=key_prefix)


@pytest.fixture
def relay(db_path: Path, redis_client: redis.Redis, settings: Settings) -> Iterator[Relay]:
    engine = outbox_engine(f"sqlite:///{db_path}")
    try:
        yield Relay(engine, Publisher(redis_client, settings))
    finally:
        engine.dispose()


def stream_task_ids(client: redis.Redis, settings: Settings) -> Counter[str]:
    keys = settings.keys.queue(QUEUE)
    return Counter(decode_entry(fields).task_id
                   for bucket in BUCKETS_BY_URGENCY
                   for _, fields in client.xrange(keys.stream(bucket)))


def test_atomic_commits_and_rollbacks(relay: Relay, redis_client: redis.Redis,
                                      settings: Settings) -> None:
    from kombu_envelope.outbox.django.models import OutboxEntry
    from kombu_envelope.outbox.django.writer import DjangoOutboxWriter, NotInTransaction

    writer = DjangoOutboxWriter(settings=settings)
    committed = Envelope.new(task_type="order.placed", payload={"n": 1})
    with transaction.atomic():
        writer.write(QUEUE, committed)
    with pytest.raises(RuntimeError), transaction.atomic():
        writer.write(QUEUE, Envelope.new(task_type="order.placed", payload={"n": 2}))
        raise RuntimeError("the request failed")
    with pytest.raises(NotInTransaction, match=r"transaction\.atomic"):
        writer.write(QUEUE, Envelope.new(task_type="order.placed"))
    assert list(OutboxEntry.objects.values_list("task_id", flat=True)) == [committed.task_id]
    assert relay.lag().waiting == 1
    assert relay.relay_batch() == 1
    assert stream_task_ids(redis_client, settings) == {committed.task_id: 1}
    assert not OutboxEntry.objects.exists()


def test_celery_delay_inside_atomic_writes_the_outbox(
        relay: Relay, redis_url: str, redis_client: redis.Redis, settings: Settings,
        key_prefix: str) -> None:
    with outbox_app(redis_url, key_prefix, "django") as (_, placed):
        with transaction.atomic():
            inside = placed.delay(1)
        outside = placed.delay(2)  # outside an atomic block: published as usual
        assert stream_task_ids(redis_client, settings) == {outside.id: 1}
        assert relay.relay_batch() == 1
    assert stream_task_ids(redis_client, settings) == {outside.id: 1, inside.id: 1}
