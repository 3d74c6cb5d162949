"""Payload schema commands: ``register``, ``list``, ``show`` and ``delete``.

The same commands serve ``celery -A proj envelope schemas ...`` (the app's
broker) and, without Celery, ``python -m kombu_envelope.schemas_cli``::

    python -m kombu_envelope.schemas_cli --url redis://localhost:6379/0 \\
        register order.close_timeout 1 order-close-v1.schema.json
    python -m kombu_envelope.schemas_cli --url redis://localhost:6379/0 list

Behind Sentinel, the sentinels' password comes from ``ENVELOPE_SENTINEL_PASSWORD``
as for :mod:`kombu_envelope.scheduler`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import IO, Any

import click

from kombu_envelope.cli_output import echo_table
from kombu_envelope.errors import InvalidSchema
from kombu_envelope.scheduler import standalone_settings
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import client_for_url
from kombu_envelope.store.schemas import PayloadSchemas

#: How a command reaches the schemas of its deployment.
SchemasOpener = Callable[[click.Context], PayloadSchemas]


def schema_commands(open_schemas: SchemasOpener) -> click.Group:
    """The ``schemas`` command group, reaching Redis through ``open_schemas``."""

    @click.group("schemas")
    def schemas() -> None:
        """Register, list, show and delete payload schemas (JSON Schema draft 2020-12)."""

    @schemas.command("register")
    @click.argument("task_type")
    @click.argument("payload_version", type=int)
    @click.argument("schema_file", type=click.File("r", encoding="utf-8"))
    @click.pass_context
    def register(ctx: click.Context, task_type: str, payload_version: int,
                 schema_file: IO[str]) -> None:
        """Register the schema in SCHEMA_FILE ('-': standard input) for TASK_TYPE at
        PAYLOAD_VERSION, replacing any; enforced everywhere within schema_cache_s."""
        try:
            schema = json.load(schema_file)
        except ValueError as exc:
            raise click.ClickException(f"{schema_file.name} is not JSON: {exc}") from exc
        try:
            open_schemas(ctx).register(task_type, payload_version, schema)
        except InvalidSchema as exc:
            raise click.ClickException(f"{task_type}@{payload_version}: {exc}") from exc
        click.echo(f"registered the schema of {task_type}@{payload_version}")

    @schemas.command("list")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_context
    def list_(ctx: click.Context, as_json: bool) -> None:
        """List the registered schemas."""
        found = open_schemas(ctx).all()
        if as_json:
            click.echo(json.dumps([{"task_type": t, "payload_version": v, "schema": s}
                                   for (t, v), s in found.items()], indent=2))
            return
        echo_table(["task_type", "payload_version", "title"],
                    [(t, v, s.get("title", "")) for (t, v), s in found.items()])

    @schemas.command("show")
    @click.argument("task_type")
    @click.argument("payload_version", type=int)
    @click.pass_context
    def show(ctx: click.Context, task_type: str, payload_version: int) -> None:
        """Print the schema of TASK_TYPE at PAYLOAD_VERSION as JSON."""
        schema = _named(lambda: open_schemas(ctx).get(task_type, payload_version))
        if schema is None:
            raise click.ClickException(f"no schema for {task_type}@{payload_version}")
        click.echo(json.dumps(schema, indent=2, ensure_ascii=False))

    @schemas.command("delete")
    @click.argument("task_type")
    @click.argument("payload_version", type=int)
    @click.pass_context
    def delete(ctx: click.Context, task_type: str, payload_version: int) -> None:
        """Delete the schema of TASK_TYPE at PAYLOAD_VERSION."""
        if not _named(lambda: open_schemas(ctx).delete(task_type, payload_version)):
            raise click.ClickException(f"no schema for {task_type}@{payload_version}")
        click.echo(f"deleted the schema of {task_type}@{payload_version}")

    return schemas


def _named(call: Callable[[], Any]) -> Any:
    """``call()``, with an invalid task type or version as a command error."""
    try:
        return call()
    except InvalidSchema as exc:
        raise click.ClickException(str(exc)) from exc


def _standalone_schemas(ctx: click.Context) -> PayloadSchemas:
    settings: Settings = ctx.obj["settings"]
    return PayloadSchemas(client_for_url(ctx.obj["url"], settings), settings)


@click.group(help="Payload schemas of kombu-envelope queues, without Celery.")
@click.option("--url", default="redis://localhost:6379/0", show_default=True,
              help="Redis URL: redis://, rediss://, or any envelope URL "
                   "(envelope-sentinel://...;..., envelope-cluster://...;...)")
@click.option("--master-name", default=None,
              help="The Sentinel group's primary, with an envelope-sentinel:// URL.")
@click.option("--key-prefix", default=Settings.key_prefix, show_default=True)
@click.pass_context
def main(ctx: click.Context, url: str, master_name: str | None, key_prefix: str) -> None:
    """Entry point of ``python -m kombu_envelope.schemas_cli``."""
    ctx.obj = {"url": url, "settings": standalone_settings(key_prefix, master_name)}


for _command in schema_commands(_standalone_schemas).commands.values():
    main.add_command(_command)


if __name__ == "__main__":
    main()
