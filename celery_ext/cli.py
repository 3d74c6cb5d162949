"""``celery envelope ...``: operate the scheduler, the outbox relay, task limits, ordering keys,
delayed tasks, dead letters and schemas.

Registered through the ``celery.commands`` entry point, so every command runs
as ``celery -A proj envelope <command>`` against the app's broker. Output is a
human-readable table; ``--json`` prints JSON instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
from datetime import datetime
from typing import Any

import click

from celery_ext.broker import broker_redis, broker_settings
from celery_ext.outbox import DB_SETTING
from celery_ext.periodic import periodic_scheduler
from kombu_envelope.cli_output import echo_table
from kombu_envelope.envelope import format_rfc3339, parse_rfc3339
from kombu_envelope.errors import EnvelopeError, InvalidTaskLimit
from kombu_envelope.outbox.options import DB_URL_ENV, DEFAULT_BATCH, DEFAULT_IDLE_S
from kombu_envelope.schemas_cli import schema_commands
from kombu_envelope.store.dead_letters import DeadLetterFilter, DeadLetters, ReplayEdit
from kombu_envelope.store.delayed import Cancellation, CancelOutcome, DelayedTasks
from kombu_envelope.store.ordering import OnDeadLetter, OrderingKeys
from kombu_envelope.store.promoter import Promoter
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.schemas import PayloadSchemas
from kombu_envelope.store.task_limits import Breaker, TaskLimit, TaskLimits


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _time(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: {exc}") from exc


def _json_object(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        loaded = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise click.BadParameter("must be a JSON object")
    return loaded


@click.group()
def envelope() -> None:
    """kombu-envelope: scheduler, delayed tasks, dead letters and payload schemas."""


@envelope.command()
@click.option("--batch", default=1000, show_default=True, help="Tasks moved per step.")
@click.pass_context
def scheduler(ctx: click.Context, batch: int) -> None:
    """Run the shared scheduler: promote delayed tasks, publish periodic ones.

    Periodic tasks are the app's beat_schedule, unless envelope_periodic_enabled
    is False. Stops on SIGINT (Ctrl-C) or SIGTERM.
    """
    app = _app(ctx)
    settings = broker_settings(app)
    periodic = periodic_scheduler(app, broker_redis(app, settings), settings)
    promoter = Promoter(lambda: broker_redis(app, settings), settings, batch=batch,
                        jobs=[periodic] if periodic is not None else [])
    names = ", ".join(entry.name for entry in periodic.entries) if periodic else ""
    click.echo(f"promoting delayed tasks (prefix {settings.key_prefix}); periodic entries: "
               f"{names or 'none'}; Ctrl-C to stop")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    promoter.start()
    try:
        while not stop.wait(1.0):  # wake up regularly so the handlers run on every platform
            pass
    finally:
        promoter.stop()
    click.echo("scheduler stopped")


@envelope.command(context_settings={"ignore_unknown_options": True})
@click.argument("options", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def dispatcher(ctx: click.Context, options: tuple[str, ...]) -> None:
    """Run the HTTP dispatcher on the app's broker (options: --host, --port,
    --tokens-file, --max-body-bytes, --batch-max, --rate, --burst, --workers; see
    docs/dispatcher.md).
    Needs the ``dispatcher`` extra."""
    import argparse

    from kombu_envelope.dispatcher.server import add_options, config_from, serve

    parser = argparse.ArgumentParser(prog="celery envelope dispatcher")
    add_options(parser)
    args = parser.parse_args(list(options))
    app = _app(ctx)
    settings = broker_settings(app)
    try:
        config = config_from(args)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    serve(broker_redis(app, settings), settings, config)


@envelope.command("outbox-relay")
@click.option("--db", default=None, help="SQLAlchemy database URL of the outbox "
              "(default: the app's envelope_outbox_db, else $ENVELOPE_OUTBOX_DB).")
@click.option("--batch", default=DEFAULT_BATCH, show_default=True,
              type=click.IntRange(min=1), help="Rows relayed per transaction.")
@click.option("--idle", default=DEFAULT_IDLE_S, show_default=True,
              help="Seconds between two looks at an empty outbox.")
@click.pass_context
def outbox_relay(ctx: click.Context, db: str | None, batch: int, idle: float) -> None:
    """Relay committed outbox rows to the app's broker (needs the ``outbox`` extra).

    Any number may run against one PostgreSQL outbox; on SQLite they take turns.
    Stops on SIGINT (Ctrl-C) or SIGTERM after the batch in progress.
    """
    from kombu_envelope.outbox.__main__ import stop_on_signals
    from kombu_envelope.outbox.relay import Relay, outbox_engine

    app = _app(ctx)
    url = db or app.conf.get(DB_SETTING) or os.environ.get(DB_URL_ENV)
    if not url:
        raise click.UsageError(f"give --db, the {DB_SETTING} setting or ${DB_URL_ENV}")
    settings = broker_settings(app)
    relay = Relay(outbox_engine(url), Publisher(broker_redis(app, settings), settings),
                  batch=batch, idle_s=idle)
    stop = stop_on_signals()
    click.echo(f"relaying the outbox (prefix {settings.key_prefix}); Ctrl-C to stop")
    relay.run(stop)
    click.echo("outbox relay stopped")


# ------------------------------------------------------------------ delayed


@envelope.group()
def limits() -> None:
    """Show and change the limits of task types (protocol section 19), at run time."""


def _limits(ctx: click.Context) -> TaskLimits:
    app = _app(ctx)
    settings = broker_settings(app)
    return TaskLimits(broker_redis(app, settings), settings)


@limits.command("set")
@click.argument("task_type")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.option("--concurrency", type=int, default=None, help="Attempts running at once.")
@click.option("--rate", type=float, default=None, help="Starts per second.")
@click.option("--burst", type=int, default=None, help="Starts allowed back to back.")
@click.option("--smooth", is_flag=True, default=None, help="Space every start evenly.")
@click.option("--breaker-ratio", type=float, default=None,
              help="Open the circuit breaker when this share of attempts failed (0-1].")
@click.option("--breaker-min-attempts", type=int, default=None,
              help="...of at least this many attempts (default 20)...")
@click.option("--breaker-window", type=float, default=None,
              help="...within this many seconds (default 60).")
@click.option("--breaker-cooldown", type=float, default=None,
              help="Seconds the breaker stays open (default 30).")
@click.option("--breaker-probes", type=int, default=None,
              help="Attempts let through half-open (default 1).")
@click.pass_context
def limits_set(ctx: click.Context, task_type: str, queue: str, concurrency: int | None,
               rate: float | None, burst: int | None, smooth: bool | None,
               breaker_ratio: float | None, breaker_min_attempts: int | None,
               breaker_window: float | None, breaker_cooldown: float | None,
               breaker_probes: int | None) -> None:
    """Give TASK_TYPE on a queue these limits, replacing the ones it had."""
    breaker_options = (breaker_min_attempts, breaker_window, breaker_cooldown, breaker_probes)
    if breaker_ratio is None and any(option is not None for option in breaker_options):
        raise click.BadParameter("the breaker options need --breaker-ratio")
    try:
        breaker = None if breaker_ratio is None else Breaker(
            breaker_ratio, breaker_min_attempts, breaker_window, breaker_cooldown, breaker_probes)
        limit = TaskLimit(concurrency=concurrency, rate=rate, burst=burst, smooth=smooth or None,
                          breaker=breaker)
        _limits(ctx).set(queue, task_type, limit)
    except InvalidTaskLimit as exc:
        raise click.BadParameter(str(exc)) from exc
    click.echo(f"limits of {task_type} on {queue}: {limit.describe()}")


@limits.command("show")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def limits_show(ctx: click.Context, queue: str, as_json: bool) -> None:
    """List the limited task types of a queue, with the state of their circuit breakers."""
    limits = _limits(ctx)
    shown = limits.all(queue)
    states = {name: limits.breaker_state(queue, name) if limit.breaker else None
              for name, limit in shown.items()}
    if as_json:
        _echo_json({name: {**limit.as_json(), **({"breaker_state": states[name]}
                                                 if states[name] else {})}
                    for name, limit in shown.items()})
    else:
        echo_table(["task_type", "limits", "breaker"],
                   [(name, limit.describe(), states[name] or "-")
                    for name, limit in shown.items()])


@limits.command("remove")
@click.argument("task_type")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.pass_context
def limits_remove(ctx: click.Context, task_type: str, queue: str) -> None:
    """Lift the limits of TASK_TYPE on a queue."""
    if not _limits(ctx).remove(queue, task_type):
        raise click.ClickException(f"{task_type} has no limits on {queue}")
    click.echo(f"limits of {task_type} on {queue} removed")


@envelope.group()
def ordering() -> None:
    """Show ordering keys, skip a stuck head, and choose what a dead letter does to its key
    (protocol section 20)."""


def _ordering(ctx: click.Context) -> OrderingKeys:
    app = _app(ctx)
    settings = broker_settings(app)
    return OrderingKeys(broker_redis(app, settings), settings)


@ordering.command("show")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.option("--key", "key", default=None, help="One ordering key (default: every key).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def ordering_show(ctx: click.Context, queue: str, key: str | None, as_json: bool) -> None:
    """List the ordering keys of a queue that have tasks: the head whose turn it is, how
    many wait behind it, and the dead-lettered head a halted key waits for."""
    keys = _ordering(ctx)
    states = [keys.state(queue, key)] if key else keys.keys(queue)
    if as_json:
        _echo_json({"keys": [dataclasses.asdict(state) for state in states],
                    "policies": {t: p.value for t, p in keys.policies(queue).items()}})
    else:
        echo_table(["key", "head", "waiting", "halted for"],
                   [(s.key, s.head or "-", str(s.waiting), s.halted_for or "-") for s in states])


@ordering.command("skip")
@click.argument("key")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.pass_context
def ordering_skip(ctx: click.Context, key: str, queue: str) -> None:
    """Move KEY on past its head (a halted one, or one whose entry is lost)."""
    head = _ordering(ctx).skip(queue, key)
    if head is None:
        raise click.ClickException(f"ordering key {key} has no tasks on {queue}")
    click.echo(f"ordering key {key} on {queue}: skipped {head}")


@ordering.command("policy")
@click.argument("task_type")
@click.argument("on_dead_letter", type=click.Choice([p.value for p in OnDeadLetter]))
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.pass_context
def ordering_policy(ctx: click.Context, task_type: str, on_dead_letter: str, queue: str) -> None:
    """What a dead-lettered head of TASK_TYPE does to its key: advance (the default) or
    halt until an operator replays or skips it."""
    _ordering(ctx).set_policy(queue, task_type, on_dead_letter)
    click.echo(f"a dead-lettered {task_type} on {queue} now makes its key {on_dead_letter}")


@envelope.group()
def delayed() -> None:
    """Inspect and cancel delayed tasks."""


def _delayed(ctx: click.Context) -> DelayedTasks:
    app = _app(ctx)
    settings = broker_settings(app)
    return DelayedTasks(broker_redis(app, settings), settings)


@delayed.command("count")
@click.option("--queue", "-Q", default=None, help="Count per task_type in this queue.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def delayed_count(ctx: click.Context, queue: str | None, as_json: bool) -> None:
    """Count delayed tasks per queue, or per task_type of one queue."""
    tasks = _delayed(ctx)
    counts = dict(tasks.count_by_task_type(queue)) if queue else tasks.counts()
    if as_json:
        _echo_json(counts)
    else:
        echo_table(["task_type" if queue else "queue", "delayed"], sorted(counts.items()))


@delayed.command("list")
@click.option("--queue", "-Q", required=True, help="Queue name.")
@click.option("--task-type", default=None, help="Only this task_type.")
@click.option("--limit", default=20, show_default=True, help="Show the N due soonest.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def delayed_list(ctx: click.Context, queue: str, task_type: str | None, limit: int,
                 as_json: bool) -> None:
    """List the delayed tasks of a queue, soonest first."""
    found = []
    for task in _delayed(ctx).iter_all(queue):
        if task_type and (task.envelope is None or task.envelope.task_type != task_type):
            continue
        found.append(task)
        if len(found) >= limit:
            break
    if as_json:
        _echo_json([{"task_id": t.task_id, "due": format_rfc3339(t.due),
                     "envelope": json.loads(t.envelope.to_json()) if t.envelope else None,
                     "error": t.error} for t in found])
        return
    echo_table(["due", "task_id", "task_type"],
               [(format_rfc3339(t.due), t.task_id,
                 t.envelope.task_type if t.envelope else f"? ({t.error})") for t in found])


@delayed.command("show")
@click.argument("task_id")
@click.option("--queue", "-Q", default=None, help="Queue name (default: search all).")
@click.pass_context
def delayed_show(ctx: click.Context, task_id: str, queue: str | None) -> None:
    """Show one delayed task as JSON."""
    task = _delayed(ctx).get(task_id, queue)
    if task is None:
        raise click.ClickException(f"no delayed task {task_id}")
    _echo_json({"queue": task.queue, "due": format_rfc3339(task.due),
                "envelope": json.loads(task.envelope.to_json()) if task.envelope else None,
                "error": task.error})


@envelope.command()
@click.argument("task_id")
@click.option("--queue", "-Q", default=None,
              help="Look for the delayed task in this queue only (default: every queue).")
@click.pass_context
def cancel(ctx: click.Context, task_id: str, queue: str | None) -> None:
    """Cancel a task, whatever its queue: mark it so that no worker runs it, and
    remove it if still delayed.

    Prints the outcome (removed, marked or already) and what it means.
    """
    tasks = _delayed(ctx)
    found = (Cancellation(tasks.cancel(task_id, queue), queue) if queue
             else tasks.cancel_everywhere(task_id))
    meaning = _CANCEL_MEANING[found.outcome].format(task_id=task_id, queue=found.queue)
    click.echo(f"{found.outcome.value}: {meaning}")


_CANCEL_MEANING = {
    CancelOutcome.REMOVED: "task {task_id} was delayed in queue {queue}; it will never run",
    CancelOutcome.MARKED: (
        "task {task_id} is not delayed; if it is in (or reaches) a stream, a worker "
        "acknowledges it without running it (mark kept 7 days); a task that already ran, "
        "or an unknown id, is not affected"
    ),
    CancelOutcome.ALREADY: "task {task_id} was already marked cancelled",
}


# ---------------------------------------------------------------------- dlq


@envelope.group()
def dlq() -> None:
    """List, inspect, purge and replay dead-lettered tasks."""


def _dead_letters(ctx: click.Context) -> DeadLetters:
    app = _app(ctx)
    settings = broker_settings(app)
    return DeadLetters(broker_redis(app, settings), settings)


def _filter_options(func: Any) -> Any:
    for option in reversed([
        click.option("--queue", "-Q", "queues", multiple=True, help="Queue (repeatable)."),
        click.option("--task-type", default=None, help="Only this task_type."),
        click.option("--failure-class", default=None, help="Only this failure class."),
        click.option("--since", default=None, help="RFC 3339 time, inclusive."),
        click.option("--until", default=None, help="RFC 3339 time, inclusive."),
    ]):
        func = option(func)
    return func


def _where(task_type: str | None, failure_class: str | None, since: str | None,
           until: str | None) -> DeadLetterFilter:
    return DeadLetterFilter(task_type=task_type, failure_class=failure_class,
                            since=_time(since), until=_time(until))


@dlq.command("list")
@_filter_options
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def dlq_list(ctx: click.Context, queues: tuple[str, ...], task_type: str | None,
             failure_class: str | None, since: str | None, until: str | None, limit: int,
             as_json: bool) -> None:
    """List dead-lettered tasks, oldest first."""
    entries = _dead_letters(ctx).list(queues or None,
                                      _where(task_type, failure_class, since, until), limit)
    if as_json:
        _echo_json([entry.as_dict() for entry in entries])
        return
    echo_table(["queue", "id", "dead_at", "failure_class", "task_type", "reason"],
               [(e.queue, e.entry_id, format_rfc3339(e.dead_at), e.failure_class,
                 e.task_type or "?", e.fields.get("reason", "")[:60]) for e in entries])


@dlq.command("show")
@click.argument("queue")
@click.argument("entry_id")
@click.pass_context
def dlq_show(ctx: click.Context, queue: str, entry_id: str) -> None:
    """Show one dead-letter entry as JSON (failure, raw fields, Envelope)."""
    entry = _dead_letters(ctx).get(queue, entry_id)
    if entry is None:
        raise click.ClickException(f"no dead-letter entry {entry_id} in {queue}")
    _echo_json(entry.as_dict())


@dlq.command("stats")
@_filter_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def dlq_stats(ctx: click.Context, queues: tuple[str, ...], task_type: str | None,
              failure_class: str | None, since: str | None, until: str | None,
              as_json: bool) -> None:
    """Count dead-lettered tasks per queue, task_type and failure class."""
    counts = _dead_letters(ctx).stats(queues or None,
                                      _where(task_type, failure_class, since, until))
    rows = sorted((*key, count) for key, count in counts.items())
    if as_json:
        _echo_json([{"queue": q, "task_type": t, "failure_class": f, "count": c}
                    for q, t, f, c in rows])
    else:
        echo_table(["queue", "task_type", "failure_class", "count"], rows)


@dlq.command("purge")
@_filter_options
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def dlq_purge(ctx: click.Context, queues: tuple[str, ...], task_type: str | None,
              failure_class: str | None, since: str | None, until: str | None,
              yes: bool) -> None:
    """Delete dead-lettered tasks (all of the selected queues, or those matching)."""
    dead = _dead_letters(ctx)
    where = _where(task_type, failure_class, since, until)
    names = list(queues) or dead.queues()
    matching = sum(1 for q in names for _ in dead.iter(q, where))
    if not matching:
        click.echo("nothing to purge")
        return
    if not yes:
        click.confirm(f"Delete {matching} dead-letter entries from {', '.join(names)}? "
                      "There is no undo", abort=True)
    click.echo(f"purged {sum(dead.purge(q, where) for q in names)}")


@dlq.command("replay")
@click.argument("queue")
@click.argument("entry_ids", nargs=-1, required=True)
@click.option("--payload", default=None, help="Replace the payload (JSON object).")
@click.option("--merge-patch", default=None, help="RFC 7386 JSON merge patch for the payload.")
@click.option("--payload-version", type=int, default=None, help="Set payload_version.")
@click.option("--bump-version", is_flag=True, help="Add one to payload_version.")
@click.option("--max-retries", type=int, default=None, help="Set max_retries.")
@click.option("--keep-retry-count", is_flag=True, help="Keep retry_count (default: reset).")
@click.pass_context
def dlq_replay(ctx: click.Context, queue: str, entry_ids: tuple[str, ...], payload: str | None,
               merge_patch: str | None, payload_version: int | None, bump_version: bool,
               max_retries: int | None, keep_retry_count: bool) -> None:
    """Publish dead-lettered tasks again, optionally edited first."""
    dead = _dead_letters(ctx)
    for entry_id in entry_ids:
        entry = dead.get(queue, entry_id)
        if entry is None:
            click.echo(f"{entry_id}: not found (already replayed or purged)")
            continue
        retry_count = entry.envelope.retry_count if keep_retry_count and entry.envelope else 0
        edit = ReplayEdit(payload=_json_object(payload), merge_patch=_json_object(merge_patch),
                          payload_version=payload_version, bump_version=bump_version,
                          retry_count=retry_count, max_retries=max_retries)
        try:
            new_id = dead.replay(queue, entry_id, edit)
        except EnvelopeError as exc:
            raise click.ClickException(f"{entry_id}: {exc}") from exc
        click.echo(f"{entry_id}: " + (f"replayed as {new_id}" if new_id else "already replayed"))


# ------------------------------------------------------------------ schemas


def _schemas(ctx: click.Context) -> PayloadSchemas:
    app = _app(ctx)
    settings = broker_settings(app)
    return PayloadSchemas(broker_redis(app, settings), settings)


envelope.add_command(schema_commands(_schemas))
