"""Periodic tasks (the app's ``beat_schedule``) run by the shared scheduler, without beat.

Every promoter of delayed tasks (the thread of each Celery worker on
``envelope://`` and ``celery -A proj envelope scheduler``) also publishes the
occurrences of the app's ``beat_schedule`` entries. Any number may run at
once and any of them may die: no single process is needed for periodic tasks.

State in Redis, per queue an entry's tasks go to::

    <prefix>:{<queue>}:periodic   HASH  <name>             -> next occurrence (ms)
                                        fingerprint:<name> -> fingerprint of its definition
    <prefix>:periodic-queues      SET   queues that have periodic entries

An occurrence is claimed and published in one step by ``periodic.lua``: the
script advances ``<name>`` only if it still holds the occurrence being
claimed, and stores the occurrence's task in the queue's delayed set in the
same call (the promoter moves it to its stream at once). However many
schedulers race, each occurrence is published exactly once; a scheduler
killed at any point leaves the occurrence claimable by the others. The task
id of an occurrence is derived from the key prefix, the entry name and the
occurrence time (:func:`occurrence_task_id`), so an occurrence is recognisable
everywhere (results, logs, cancellation). The same call writes the occurrence's
task record (``scheduled``, due at the occurrence; docs/protocol.md, section 14).

An occurrence whose task cannot be built (its payload breaks its schema,
:mod:`kombu_envelope.store.schemas`, for one) is logged and skipped.

Catch-up after downtime: when no scheduler ran for a while, the first missed
occurrence is published once as soon as one runs again, the other missed
ones are skipped, and the next occurrence is the first one after now.

Changes to ``beat_schedule`` take effect when a scheduler starts
(:meth:`PeriodicScheduler.sync`): new entries get their first occurrence,
entries whose definition changed (task, schedule, args, kwargs, options) start
again from now, entries no longer in the schedule are deleted. A scheduler
still running an older definition leaves entries whose fingerprint is not its
own alone, so the newest definition wins during a rolling restart. One key
prefix has one schedule: apps with different schedules need different
prefixes.

The Celery setting ``envelope_periodic_enabled``:

* unset (default): run ``beat_schedule`` when it has entries; an app without
  entries leaves the stored schedule untouched (a worker of another service
  on the same prefix never erases it);
* ``True``: always; an empty ``beat_schedule`` then deletes every entry;
* ``False``: never, for deployments that keep ``celery beat``.

Schedules are Celery's: numbers and timedeltas (intervals, whose occurrences
keep their phase), :class:`~celery.schedules.crontab` in the app's timezone,
and :class:`~celery.schedules.solar` (which needs :pypi:`ephem`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import cached_property
from typing import Any

from celery import signals
from celery.schedules import BaseSchedule, crontab, maybe_schedule, solar
from celery.schedules import schedule as interval
from kombu.serialization import dumps
from redis.exceptions import RedisError, WatchError

from celery_ext.broker import broker_settings
from celery_ext.protocol import CeleryAdapter
from kombu_envelope.codec import encode_body
from kombu_envelope.envelope import Envelope, format_rfc3339, utcnow
from kombu_envelope.errors import InvalidQueueName
from kombu_envelope.keys import bucket_for
from kombu_envelope.settings import Settings
from kombu_envelope.store.batch import Batch
from kombu_envelope.store.periodic_entries import FINGERPRINT_FIELD_PREFIX
from kombu_envelope.store.promoter import redis_now_ms
from kombu_envelope.store.replies import as_text
from kombu_envelope.store.schemas import PayloadSchemas
from kombu_envelope.store.task_records import (
    RecordWrite,
    TaskState,
    envelope_fields,
    record_write,
)

__all__ = [
    "ENABLED_SETTING",
    "PeriodicEntry",
    "PeriodicScheduler",
    "SyncReport",
    "entries_of",
    "following_occurrence",
    "next_occurrence",
    "occurrence_record",
    "occurrence_task_id",
    "periodic_scheduler",
]

logger = logging.getLogger(__name__)

#: Celery setting: None (default) runs a non-empty beat_schedule, True always, False never.
ENABLED_SETTING = "envelope_periodic_enabled"
#: Namespace of the uuid5 task ids of occurrences.
OCCURRENCE_NAMESPACE = uuid.UUID("1daf98c6-0a35-4b38-bedf-a428601b5a38")

# Options that choose where and how a message is sent, not properties of the message.
_SENDING_OPTIONS = frozenset({
    "queue", "exchange", "routing_key", "exchange_type", "serializer", "compression", "retry",
    "retry_policy", "declare", "delivery_mode", "headers", "event_dispatcher", "timeout",
    "confirm_timeout", "immediate", "mandatory", "expiration",
})
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: Pause after an unexpected error of the periodic job (ms).
RETRY_AFTER_MS = 5_000


# --------------------------------------------------------------- occurrences


def occurrence_task_id(key_prefix: str, name: str, occurrence_ms: int) -> str:
    """The task id of entry ``name``'s occurrence at ``occurrence_ms`` (a uuid5)."""
    return str(uuid.uuid5(OCCURRENCE_NAMESPACE, f"{key_prefix}\n{name}\n{occurrence_ms}"))


def _utc(ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=ms)


def _ms(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(milliseconds=1)


def _interval_ms(sched: BaseSchedule) -> int | None:
    """The period in ms of a plain interval schedule; None for every other schedule."""
    if isinstance(sched, interval) and not sched.relative:
        return int(sched.run_every // timedelta(milliseconds=1))
    return None


def next_occurrence(sched: BaseSchedule, after_ms: int, now_ms: int) -> int:
    """The first occurrence of ``sched`` strictly after ``after_ms`` (ms since the epoch).

    ``now_ms`` is the clock the schedule reads (Redis time, shared by every scheduler).
    """
    step = _interval_ms(sched)
    if step is not None:
        return after_ms + step
    now = _utc(now_ms)
    frozen = copy.copy(sched)  # the same schedule, reading the shared clock
    frozen.app = sched.app  # copies are rebuilt from __reduce__, which leaves the app out
    frozen.nowfun = lambda: now
    found = _ms(now + frozen.remaining_estimate(_utc(after_ms)))
    return found if found > after_ms else after_ms + 1000  # never loop on one instant


def following_occurrence(sched: BaseSchedule, claimed_ms: int, now_ms: int) -> int:
    """The occurrence to store once ``claimed_ms`` is published: always after ``now_ms``.

    Occurrences missed meanwhile are skipped (the claimed one runs once for
    all of them); an interval keeps its phase.
    """
    step = _interval_ms(sched)
    if step is not None:
        following = claimed_ms + step
        if following <= now_ms:
            following += ((now_ms - following) // step + 1) * step
        return following
    following = next_occurrence(sched, claimed_ms, now_ms)
    if following <= now_ms:
        following = next_occurrence(sched, now_ms, now_ms)
    return following


# ------------------------------------------------------------------- entries


def describe_schedule(sched: BaseSchedule) -> dict[str, Any]:
    """What defines a schedule's occurrences, as JSON-compatible data."""
    if isinstance(sched, interval):
        return {"every_s": sched.run_every.total_seconds(), "relative": sched.relative}
    if isinstance(sched, crontab):
        return {"crontab": repr(sched), "timezone": str(sched.tz)}
    if isinstance(sched, solar):
        return {"solar": sched.event, "lat": sched.lat, "lon": sched.lon}
    return {"schedule": repr(sched)}


@dataclass(frozen=True)
class PeriodicEntry:
    """One ``beat_schedule`` entry, with the queue its tasks go to."""

    name: str
    task: str
    schedule: BaseSchedule
    queue: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def fingerprint(self) -> str:
        """Digest of task, schedule, args, kwargs and options: a change resets the entry."""
        definition = {"task": self.task, "schedule": describe_schedule(self.schedule),
                      "args": list(self.args), "kwargs": dict(self.kwargs),
                      "options": dict(self.options)}
        text = json.dumps(definition, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def fingerprint_field(self) -> str:
        """Hash field holding the fingerprint."""
        return FINGERPRINT_FIELD_PREFIX + self.name


def _exec_options(app: Any, task_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The task's own execution options (as ``apply_async`` merges them), then ``options``."""
    task = app.tasks.get(task_name)
    merged: dict[str, Any] = {}
    if task is not None:
        merged.update((k, v) for k, v in task._get_exec_options().items() if v is not None)
        if task.ignore_result is not None:
            merged["ignore_result"] = task.ignore_result
    merged.update(options)
    return merged


def _queue_of(app: Any, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any],
              options: Mapping[str, Any]) -> str:
    """The queue a task goes to: its options, ``task_routes``, or the default queue."""
    routed = app.amqp.router.route(dict(_exec_options(app, task_name, options)), task_name,
                                   args, kwargs, app.tasks.get(task_name))
    queue = routed.get("queue")
    if queue is None:
        return str(app.conf.task_default_queue)
    return queue if isinstance(queue, str) else str(queue.name)


def entry_from(app: Any, name: str, spec: Mapping[str, Any]) -> PeriodicEntry:
    """Parse one ``beat_schedule`` entry; ValueError names what is wrong."""
    if not isinstance(name, str) or not name or name.startswith(FINGERPRINT_FIELD_PREFIX):
        raise ValueError(f"entry names must be non-empty and not start with "
                         f"{FINGERPRINT_FIELD_PREFIX!r}")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("task"), str):
        raise ValueError("an entry needs a 'task' name")
    if spec.get("schedule") is None:
        raise ValueError("an entry needs a 'schedule'")
    sched = maybe_schedule(spec["schedule"], spec.get("relative", False), app=app)
    if not isinstance(sched, BaseSchedule):
        raise ValueError(f"unsupported schedule {spec['schedule']!r}")
    step = _interval_ms(sched)
    if step is not None and step < 1:
        raise ValueError("an interval must be at least 1 ms")
    args = tuple(spec.get("args") or ())
    kwargs = dict(spec.get("kwargs") or {})
    options = dict(spec.get("options") or {})
    queue = _queue_of(app, spec["task"], args, kwargs, options)
    return PeriodicEntry(name, spec["task"], sched, queue, args, kwargs, options)


def entries_of(app: Any) -> list[PeriodicEntry]:
    """The app's ``beat_schedule`` entries; a broken entry is logged and left out."""
    entries = []
    for name, spec in (app.conf.beat_schedule or {}).items():
        try:
            entries.append(entry_from(app, name, spec))
        except Exception as exc:  # one broken entry must not stop the others
            logger.error("periodic entry %r left out: %s", name, exc)
    return entries


# ------------------------------------------------------------ task messages


@dataclass(frozen=True)
class OccurrenceTask:
    """The task of one occurrence, built as ``apply_async`` would build it."""

    queue: str
    envelope: Envelope
    body: Any
    headers: dict[str, Any]


def build_occurrence_task(app: Any, entry: PeriodicEntry, task_id: str,
                          adapter: CeleryAdapter, settings: Settings) -> OccurrenceTask:
    """The Celery task message of an occurrence, as an Envelope.

    The message comes from ``app.amqp.create_task_message`` with the task's
    execution options and the entry's options, and goes through the
    ``before_task_publish`` receivers like any task (``after_task_publish`` is
    sent only by the scheduler that stores the occurrence).
    """
    options = _exec_options(app, entry.task, entry.options)
    headers, properties, body, _ = app.amqp.create_task_message(
        task_id, entry.task, list(entry.args), dict(entry.kwargs),
        expires=options.get("expires"), time_limit=options.get("time_limit"),
        soft_time_limit=options.get("soft_time_limit"), reply_to=app.thread_oid,
        ignore_result=bool(options.get("ignore_result", False)),
    )
    headers.update(options.get("headers") or {})
    properties.update((k, v) for k, v in options.items()
                      if k not in _SENDING_OPTIONS and k not in (
                          "expires", "time_limit", "soft_time_limit", "ignore_result"))
    properties.setdefault("priority", None)
    signals.before_task_publish.send(
        sender=entry.task, body=body, exchange="", routing_key=entry.queue, declare=[],
        headers=headers, properties=properties, retry_policy={},
    )
    serializer = options.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, data = dumps(body, serializer=serializer)
    message = {
        "body": data, "content-type": content_type, "content-encoding": content_encoding,
        "headers": headers,
        "properties": {**properties, "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": entry.queue}},
    }
    envelope = adapter.to_envelope(message, data, settings.limits)
    if envelope is None:  # pragma: no cover - a message with task and id headers is a task
        raise ValueError(f"task {entry.task!r} did not become an Envelope")
    return OccurrenceTask(entry.queue, envelope, body, headers)


def occurrence_record(settings: Settings, queue: str, envelope: Envelope,
                      occurrence_ms: int) -> RecordWrite:
    """The task record ``periodic.lua`` writes for an occurrence it stores: ``scheduled``,
    due at the occurrence (docs/protocol.md, section 14)."""
    now = utcnow()
    return record_write(settings, queue, envelope.task_id, TaskState.SCHEDULED,
                        {**envelope_fields(envelope, queue, now), "published_at": now,
                         "due_at": _utc(occurrence_ms)},
                        due_ms=occurrence_ms, now=now)


# --------------------------------------------------------------- scheduler


@dataclass
class SyncReport:
    """What :meth:`PeriodicScheduler.sync` changed."""

    added: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)



def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class PeriodicScheduler:
    """Publishes the occurrences of periodic entries; a :class:`Promoter` job.

    Call it with the Redis time in ms: the first call syncs the entries with
    Redis, every call publishes the due occurrences and returns when it next
    needs to run (``now_ms`` when it published something, so the promoter
    promotes it at once).
    """

    def __init__(self, app: Any, client: Any, settings: Settings | None = None,
                 entries: Iterable[PeriodicEntry] | None = None) -> None:
        self.app = app
        self.client = client
        self.settings = settings or broker_settings(app)
        self.entries = list(entries_of(app) if entries is None else entries)
        self.adapter = CeleryAdapter()
        self.schemas = PayloadSchemas(client, self.settings)
        self.synced = False
        # Entries whose task could not be built: name -> ms before which to skip them.
        self._skip_until: dict[str, int] = {}

    @property
    def by_queue(self) -> dict[str, list[PeriodicEntry]]:
        """Entries grouped by queue."""
        grouped: dict[str, list[PeriodicEntry]] = {}
        for entry in self.entries:
            grouped.setdefault(entry.queue, []).append(entry)
        return grouped

    def __call__(self, now_ms: int) -> int | None:
        try:
            if not self.synced:
                self.sync(now_ms)
            published, earliest = self.run_due(now_ms)
        except RedisError:
            raise  # the promoter waits for Redis and calls again
        except Exception:  # never stop the promotion of delayed tasks
            logger.exception("periodic tasks failed; trying again in %d s", RETRY_AFTER_MS // 1000)
            return now_ms + RETRY_AFTER_MS
        return now_ms if published else earliest

    # -- sync ------------------------------------------------------------------

    def sync(self, now_ms: int | None = None, *, add_only: bool = False) -> SyncReport:
        """Make Redis hold exactly this scheduler's entries (see the module documentation).

        With ``add_only`` only missing entries are written: nothing is reset or
        deleted (used to rebuild what a Redis restart without persistence lost).
        """
        now_ms = redis_now_ms(self.client) if now_ms is None else now_ms
        keys = self.settings.keys
        by_queue = self.by_queue
        queues = set(by_queue)
        if not add_only:
            queues.update(as_text(q) for q in self.client.smembers(keys.periodic_queues))
        report = SyncReport()
        earliest: int | None = None
        for queue in sorted(queues):
            try:
                queue_earliest = self._sync_queue(queue, by_queue.get(queue, []), now_ms,
                                                  add_only, report)
            except InvalidQueueName:
                logger.warning("skipping invalid queue name %r in %s", queue,
                               keys.periodic_queues)
                continue
            if queue_earliest is not None and (earliest is None or queue_earliest < earliest):
                earliest = queue_earliest
        if earliest is not None:  # wake sleeping schedulers: an entry may now be due sooner
            self.client.publish(keys.wakeup_channel, earliest)
        self.synced = True
        for kind in ("added", "reset", "removed"):
            names = getattr(report, kind)
            if names:
                logger.info("periodic entries %s: %s", kind, ", ".join(sorted(names)))
        return report

    def _sync_queue(self, queue: str, ours: list[PeriodicEntry], now_ms: int, add_only: bool,
                    report: SyncReport) -> int | None:
        """Sync one queue's hash atomically (WATCH); return the earliest occurrence written.

        The registry is another slot: the queue is listed before its hash is written
        and unlisted only after its hash lost its last entry (section 2, registries).
        """
        key = self.settings.keys.queue(queue).periodic
        registry = self.settings.keys.periodic_queues
        if ours:
            self.client.sadd(registry, queue)
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    stored = {as_text(k): as_text(v) for k, v in pipe.hgetall(key).items()}
                    writes: dict[str, str] = {}
                    added: list[str] = []
                    reset: list[str] = []
                    kept: list[str] = []
                    for entry in ours:
                        known = _int_or_none(stored.get(entry.name))
                        same = stored.get(entry.fingerprint_field) == entry.fingerprint
                        if known is not None and (same or add_only):
                            kept.append(entry.name)
                            continue
                        first = next_occurrence(entry.schedule, now_ms, now_ms)
                        writes[entry.name] = str(first)
                        writes[entry.fingerprint_field] = entry.fingerprint
                        (added if known is None else reset).append(entry.name)
                    names = {e.name for e in ours} | {e.fingerprint_field for e in ours}
                    stale = [] if add_only else sorted(set(stored) - names)
                    pipe.multi()
                    if writes:
                        pipe.hset(key, mapping=writes)
                    if stale:
                        pipe.hdel(key, *stale)
                    pipe.execute()
                except WatchError:  # another scheduler synced this queue meanwhile
                    continue
                if not ours and not add_only:
                    self.client.srem(registry, queue)
                report.added += added
                report.reset += reset
                report.kept += kept
                report.removed += [n for n in stale
                                   if not n.startswith(FINGERPRINT_FIELD_PREFIX)]
                firsts = [int(v) for k, v in writes.items()
                          if not k.startswith(FINGERPRINT_FIELD_PREFIX)]
                return min(firsts) if firsts else None

    # -- publishing ------------------------------------------------------------

    def stored(self) -> dict[str, tuple[int | None, str | None]]:
        """Each entry's stored (next occurrence ms, fingerprint), one round trip."""
        return self._read()[1]

    def _read(self) -> tuple[bool, dict[str, tuple[int | None, str | None]]]:
        """Whether the queue registry exists, and :meth:`stored`."""
        by_queue = self.by_queue
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.settings.keys.periodic_queues)
        for queue, entries in by_queue.items():
            pipe.hmget(self.settings.keys.queue(queue).periodic,
                       [f for e in entries for f in (e.name, e.fingerprint_field)])
        registry, *replies = pipe.execute()
        found: dict[str, tuple[int | None, str | None]] = {}
        for entries, values in zip(by_queue.values(), replies):
            for entry, next_ms, fingerprint in zip(entries, values[::2], values[1::2]):
                found[entry.name] = (_int_or_none(next_ms),
                                     None if fingerprint is None else as_text(fingerprint))
        return bool(registry), found

    def run_due(self, now_ms: int) -> tuple[int, int | None]:
        """Publish every due occurrence; return (published here, earliest next occurrence)."""
        if not self.entries:
            return 0, None
        registry, stored = self._read()
        if not registry:
            logger.warning("%s is missing (did Redis lose its data?): re-creating the "
                           "periodic entries", self.settings.keys.periodic_queues)
            self.sync(now_ms, add_only=True)
            stored = self.stored()
        published = 0
        earliest: int | None = None
        for entry in self.entries:
            next_ms, fingerprint = stored[entry.name]
            if next_ms is None or fingerprint != entry.fingerprint:
                continue  # removed or redefined by a newer scheduler: not ours to run
            if next_ms <= now_ms and self._skip_until.get(entry.name, 0) <= now_ms:
                following = following_occurrence(entry.schedule, next_ms, now_ms)
                published += self._publish(entry, next_ms, following)
                next_ms = following
            elif next_ms <= now_ms:
                next_ms = self._skip_until[entry.name]
            if earliest is None or next_ms < earliest:
                earliest = next_ms
        return published, earliest

    def _publish(self, entry: PeriodicEntry, occurrence_ms: int, following_ms: int) -> int:
        """Claim and publish one occurrence; 1 when this scheduler stored it, else 0."""
        task_id = occurrence_task_id(self.settings.key_prefix, entry.name, occurrence_ms)
        try:
            task = build_occurrence_task(self.app, entry, task_id, self.adapter, self.settings)
            self.schemas.check(task.envelope)
            enc, body = encode_body(task.envelope, self.settings.gzip_min_bytes,
                                    limits=self.settings.limits)
        except RedisError:
            raise
        except Exception:
            logger.exception("periodic entry %r: cannot build task %r; skipping the "
                             "occurrence at %s", entry.name, entry.task,
                             format_rfc3339(_utc(occurrence_ms)))
            self._skip_until[entry.name] = following_ms
            return 0
        self._skip_until.pop(entry.name, None)
        keys = self.settings.keys.queue(entry.queue)
        record = occurrence_record(self.settings, entry.queue, task.envelope, occurrence_ms)
        batch = Batch(self.client)
        batch.first("sadd", self.settings.keys.queues, entry.queue)  # promoters find it
        batch.script("periodic", [keys.periodic, keys.delayed, keys.delayed_data, *record.keys],
                     [entry.name, occurrence_ms, following_ms, task_id,
                      bucket_for(task.envelope.priority).value, enc, body,
                      self.settings.keys.wakeup_channel, *record.args])
        claimed = int(batch.execute()[0])
        if claimed:
            signals.after_task_publish.send(sender=entry.task, body=task.body,
                                            headers=task.headers, exchange="",
                                            routing_key=entry.queue)
            logger.info("periodic entry %r: published %s[%s] for %s", entry.name, entry.task,
                        task_id, format_rfc3339(_utc(occurrence_ms)))
        return claimed


def periodic_scheduler(app: Any, client: Any,
                       settings: Settings | None = None) -> PeriodicScheduler | None:
    """The app's periodic scheduler, or None when ``envelope_periodic_enabled`` says not to."""
    enabled = app.conf.get(ENABLED_SETTING)
    if enabled is not None and not enabled:
        return None
    entries = entries_of(app)
    if not entries and not enabled:
        return None
    return PeriodicScheduler(app, client, settings, entries)
