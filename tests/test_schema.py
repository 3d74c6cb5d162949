"""The generated JSON Schema: checked in, up to date, and agreeing with the vectors."""

from __future__ import annotations

import calendar
import json
import re
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator, FormatChecker, ValidationError

from kombu_envelope.schema import (
    SCHEMA_DIR,
    SCHEMAS,
    envelope_json_schema,
    main,
    render,
    stale_schemas,
    write_schemas,
)

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "conformance"
MANIFEST = json.loads((CONFORMANCE / "manifest.json").read_text(encoding="utf-8"))
CHECKED_IN = SCHEMA_DIR / "envelope.schema.json"

_DATE_TIME = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?"
    r"(?:[Zz]|[+-]([0-9]{2}):([0-9]{2}))"
)


def is_date_time(value: object) -> bool:
    """RFC 3339 ``date-time`` (without leap seconds), written independently of the library."""
    if not isinstance(value, str):
        return True
    match = _DATE_TIME.fullmatch(value)
    if match is None:
        return False
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    off_hour, off_minute = (int(part or 0) for part in match.groups()[7:])
    return (
        1 <= month <= 12
        and 1 <= day <= calendar.monthrange(max(year, 1), month)[1]
        and hour <= 23 and minute <= 59 and second <= 59
        and off_hour <= 23 and off_minute <= 59
    )


FORMATS = FormatChecker(formats=())
FORMATS.checks("date-time")(is_date_time)


def validator() -> Draft202012Validator:
    return Draft202012Validator(envelope_json_schema(), format_checker=FORMATS)


def load(relative: str) -> dict[str, Any]:
    case: dict[str, Any] = json.loads((CONFORMANCE / relative).read_text(encoding="utf-8"))
    return case


# --- the checked-in files ---------------------------------------------------


def test_the_checked_in_schema_is_what_the_model_generates() -> None:
    assert CHECKED_IN.read_text(encoding="utf-8") == render(envelope_json_schema())
    assert stale_schemas() == []


def test_the_checked_in_schema_is_pretty_sorted_and_ends_with_a_newline() -> None:
    text = CHECKED_IN.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_the_schema_is_a_valid_draft_2020_12_schema_with_identity() -> None:
    schema = envelope_json_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"]
    assert schema["title"] == "Envelope"
    assert schema["description"]
    assert schema["additionalProperties"] is False
    assert sorted(schema["required"]) == ["created_at", "task_id", "task_type", "trace_id"]


def test_timestamps_are_strings_with_an_offset_pattern() -> None:
    properties = envelope_json_schema()["properties"]
    created_at = properties["created_at"]
    scheduled = properties["schedule_time"]["anyOf"][0]
    for timestamp in (created_at, scheduled):
        assert timestamp["type"] == "string"
        assert timestamp["format"] == "date-time"
        assert "(?P<" not in timestamp["pattern"]  # portable (ECMA 262) syntax
        assert re.search(timestamp["pattern"], "2025-09-11T12:45:00+08:00")
        assert not re.search(timestamp["pattern"], "2025-09-11T12:45:00")


def test_ext_namespaces_are_constrained_by_property_names() -> None:
    ext = envelope_json_schema()["properties"]["ext"]
    assert "patternProperties" not in ext
    assert ext["propertyNames"]["pattern"]
    assert ext["additionalProperties"]["type"] == "object"


def test_write_and_check_round_trip(tmp_path: Path) -> None:
    assert main(["--check", "--directory", str(tmp_path)]) == 1
    written = write_schemas(tmp_path)
    assert [path.name for path in written] == list(SCHEMAS)
    assert main(["--check", "--directory", str(tmp_path)]) == 0
    (tmp_path / "envelope.schema.json").write_text("{}\n", encoding="utf-8")
    assert main(["--check", "--directory", str(tmp_path)]) == 1
    assert main(["--directory", str(tmp_path)]) == 0
    assert main(["--check", "--directory", str(tmp_path)]) == 0


def test_the_check_command_passes_on_the_repository() -> None:
    assert main(["--check"]) == 0


# --- agreement with the conformance vectors ---------------------------------


def schema_input(case: dict[str, Any]) -> Any:
    value = case["input"]
    if isinstance(value, dict) and set(value) == {"raw"}:
        return json.loads(value["raw"])
    return value


def matches_field(error: ValidationError, field: str) -> bool:
    """Whether a schema error is about the vector's offending field."""
    top = field.split(".")[0]
    path = list(error.absolute_path)
    if path:
        return bool(path[0] == top)
    if field == "envelope":
        return True
    return error.validator in ("required", "additionalProperties") and repr(top) in error.message


def flatten(errors: list[ValidationError]) -> list[ValidationError]:
    found = []
    for error in errors:
        found.append(error)
        found.extend(flatten(list(error.context or [])))
    return found


SCHEMA_VECTORS = [name for name in MANIFEST["envelopes"] if load(name).get("schema_checks", True)]


def test_most_vectors_are_checked_against_the_schema() -> None:
    assert len(SCHEMA_VECTORS) >= 0.75 * len(MANIFEST["envelopes"])


@pytest.mark.parametrize("relative", SCHEMA_VECTORS)
def test_the_schema_agrees_with_the_envelope_vector(relative: str) -> None:
    case = load(relative)
    errors = list(validator().iter_errors(schema_input(case)))
    if case["valid"]:
        assert errors == []
        return
    assert errors, f"the schema accepts an input refused for {case['field']}: {case['rule']}"
    assert any(matches_field(error, case["field"]) for error in flatten(errors)), errors


@pytest.mark.parametrize(
    "relative", [name for name in MANIFEST["entries"] if load(name)["valid"]]
)
def test_the_decoded_envelope_of_a_valid_entry_vector_matches_the_schema(relative: str) -> None:
    validator().validate(load(relative)["envelope"])
