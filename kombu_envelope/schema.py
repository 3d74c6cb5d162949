"""JSON Schemas (draft 2020-12) of the wire formats, generated from the pydantic models.

The schemas describe what is on the wire, so other languages can validate
their input: timestamps are RFC 3339 strings with an offset, integers are
integers. A few rules cannot be written in JSON Schema (payload depth and
size, ``retry_count <= max_retries``, the publish-time maximum delay); they
are listed in ``conformance/README.md``.

``python -m kombu_envelope.schema`` rewrites the checked-in files under
``kombu_envelope/schemas/``; ``--check`` exits with status 1 when one of
them differs from what the models generate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from kombu_envelope.dead_letter_entry import DeadLetterEntry
from kombu_envelope.envelope import Envelope

#: The JSON Schema dialect of every generated schema.
DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: Prefix of the ``$id`` of every generated schema.
ID_PREFIX = "urn:kombu-envelope:schema:"
#: Where the generated schemas are checked in.
SCHEMA_DIR = Path(__file__).with_name("schemas")


class WireJsonSchema(GenerateJsonSchema):
    """Schema generator for input validation in any language.

    pydantic describes a mapping with constrained keys as ``patternProperties``,
    which lets keys that do not match through; this writes ``propertyNames``.
    """

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        """An object whose keys must all match the key pattern, if there is one."""
        json_schema = super().dict_schema(schema)
        patterns = json_schema.pop("patternProperties", None)
        if patterns:
            ((pattern, values),) = patterns.items()
            json_schema["propertyNames"] = {**json_schema.get("propertyNames", {}),
                                            "pattern": pattern}
            json_schema["additionalProperties"] = values
        return json_schema


def _wire_schema(
    model: type[BaseModel], name: str, title: str, description: str
) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation", schema_generator=WireJsonSchema)
    schema.update({
        "$schema": DIALECT,
        "$id": f"{ID_PREFIX}{name}:v1",
        "title": title,
        "description": description,
    })
    return schema


def envelope_json_schema() -> dict[str, Any]:
    """The JSON Schema of an Envelope as stored in a stream entry body."""
    return _wire_schema(
        Envelope,
        "envelope",
        "Envelope",
        "A task as every language reads and writes it (Envelope format v1). Not "
        "expressible here: payload nesting depth and JSON size limits, "
        "retry_count <= max_retries, and the maximum schedule delay at publish.",
    )


def dead_letter_json_schema() -> dict[str, Any]:
    """The JSON Schema of a dead-letter stream entry (its fields as strings)."""
    return _wire_schema(
        DeadLetterEntry,
        "dead-letter",
        "Dead-letter entry",
        "The fields of an entry of a dead-letter stream (format dlq = 1): the failure, "
        "then every field of the original stream entry under raw.<field>.",
    )


#: File name -> function building the schema. One line here publishes another schema.
SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "envelope.schema.json": envelope_json_schema,
    "dead_letter.schema.json": dead_letter_json_schema,
}


def render(schema: dict[str, Any]) -> str:
    """The checked-in text of ``schema``: indented, sorted keys, trailing newline."""
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_schemas(directory: str | Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema of :data:`SCHEMAS` into ``directory``; return the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in SCHEMAS.items():
        path = directory / name
        path.write_text(render(build()), encoding="utf-8")
        written.append(path)
    return written


def stale_schemas(directory: str | Path = SCHEMA_DIR) -> list[Path]:
    """The schema files in ``directory`` that are missing or differ from the models."""
    stale = []
    for name, build in SCHEMAS.items():
        path = Path(directory) / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render(build()):
            stale.append(path)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the schemas, or with ``--check`` report stale ones."""
    parser = argparse.ArgumentParser(
        prog="python -m kombu_envelope.schema",
        description="Generate the JSON Schemas of the kombu-envelope wire formats.",
    )
    parser.add_argument(
        "--check", action="store_true",
        help="write nothing; exit 1 if a checked-in schema differs from the models",
    )
    parser.add_argument(
        "--directory", type=Path, default=SCHEMA_DIR,
        help=f"where the schemas live (default: {SCHEMA_DIR})",
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_schemas(args.directory)
        for path in stale:
            print(f"{path} is out of date; run python -m kombu_envelope.schema", file=sys.stderr)
        return 1 if stale else 0
    for path in write_schemas(args.directory):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
