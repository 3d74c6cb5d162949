"""The language-neutral conformance vectors, run against the Python implementation.

``conformance/README.md`` describes the format; implementations in other
languages run the same files.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kombu_envelope.codec import decode_entry
from kombu_envelope.envelope import Envelope, check_publishable, format_rfc3339, utcnow
from kombu_envelope.errors import InvalidEnvelope, InvalidTaskLimit, MalformedEntry
from kombu_envelope.store.schemas import SCHEMA_RULE, compile_schema, payload_violations
from kombu_envelope.store.task_limits import parse_limit

ROOT = Path(__file__).resolve().parent.parent / "conformance"
MANIFEST = json.loads((ROOT / "manifest.json").read_text(encoding="utf-8"))
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: The rule names a violation may carry (documented in conformance/README.md).
RULES = {
    "required", "unknown_field", "type", "json", "json_value", "pattern", "length", "range",
    "rfc3339", "timezone_required", "max_depth", "max_bytes", "retry_count_le_max_retries",
    "max_delay",
}
#: Why an entry is malformed (documented in conformance/README.md), as the Python
#: implementation words it.
ENTRY_ERRORS = {
    "missing_field": "missing field",
    "version": "unsupported wire version",
    "encoding": "unknown encoding",
    "gzip": "body is not valid gzip",
    "too_large": "body too large",
    "envelope": "invalid envelope",
}
ENVELOPE_KEYS = {"name", "description", "input", "valid", "field", "rule", "expect",
                 "schema_checks", "publish", "schedule_offset_s"}
ENTRY_KEYS = {"name", "description", "fields", "valid", "envelope", "error", "field", "rule"}
SCHEMA_KEYS = {"name", "description", "schema", "payload", "violations"}


@functools.cache
def load(relative: str) -> dict[str, Any]:
    """One vector file (cached: treat it as read-only)."""
    case: dict[str, Any] = json.loads((ROOT / relative).read_text(encoding="utf-8"))
    return case


def json_text(case: dict[str, Any]) -> str:
    """The vector's input as the JSON text a reader receives."""
    value = case["input"]
    if isinstance(value, dict) and set(value) == {"raw"}:
        raw: str = value["raw"]
        return raw
    if "schedule_offset_s" in case:
        when = utcnow() + timedelta(seconds=case["schedule_offset_s"])
        value = {**value, "schedule_time": format_rfc3339(when)}
    return json.dumps(value, ensure_ascii=False)


def entry_fields(case: dict[str, Any]) -> dict[bytes, bytes]:
    """The vector's entry fields as redis-py returns them."""
    fields = {}
    for name, value in case["fields"].items():
        if name == "body_base64":
            fields[b"body"] = base64.b64decode(value, validate=True)
        else:
            fields[name.encode()] = value.encode()
    return fields


# --- the suite itself -------------------------------------------------------


def test_the_manifest_lists_every_vector_file() -> None:
    on_disk = {
        "envelopes": sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("envelopes/*.json")),
        "entries": sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("entries/*.json")),
        "schemas": sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("schemas/*.json")),
        "limits": sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("limits/*.json")),
    }
    assert MANIFEST["limits"] == on_disk["limits"]
    assert MANIFEST["envelopes"] == on_disk["envelopes"]
    assert MANIFEST["entries"] == on_disk["entries"]
    assert MANIFEST["schemas"] == on_disk["schemas"]
    assert MANIFEST["format_version"] == 1


def test_there_are_enough_vectors_and_every_rule_is_exercised() -> None:
    cases = [load(name) for name in MANIFEST["envelopes"]]
    assert len(cases) >= 40
    used = {case["rule"] for case in cases if not case["valid"]}
    # Only native values (NaN, sets, dates) break json_value: unit tests cover it.
    assert used == RULES - {"json_value"}


def test_every_rule_and_entry_error_is_documented() -> None:
    for name in RULES | set(ENTRY_ERRORS):
        assert f"`{name}`" in README, name


@pytest.mark.parametrize("relative", MANIFEST["envelopes"])
def test_envelope_vector_is_well_formed(relative: str) -> None:
    case = load(relative)
    assert set(case) <= ENVELOPE_KEYS
    assert case["name"] == Path(relative).stem
    assert case["description"]
    assert isinstance(case["valid"], bool)
    if case["valid"]:
        assert "field" not in case and "rule" not in case
    else:
        assert case["rule"] in RULES
        assert case["field"]
    assert ("schedule_offset_s" in case) == case.get("publish", False)


@pytest.mark.parametrize("relative", MANIFEST["entries"])
def test_entry_vector_is_well_formed(relative: str) -> None:
    case = load(relative)
    assert set(case) <= ENTRY_KEYS
    assert case["name"] == Path(relative).stem
    assert not ({"body", "body_base64"} <= set(case["fields"]))
    assert all(isinstance(value, str) for value in case["fields"].values())
    if case["valid"]:
        assert isinstance(case["envelope"], dict)
        assert "error" not in case
    else:
        assert case["error"] in ENTRY_ERRORS
        assert ("field" in case) == ("rule" in case)
        assert "field" not in case or case["error"] == "envelope"


# --- the Python implementation against the vectors --------------------------


def verdict(parse: Callable[[], Envelope], case: dict[str, Any]) -> None:
    """Check ``parse()`` (and the publish rules, if asked) against the vector's verdict."""
    try:
        env = parse()
        if case.get("publish"):
            check_publishable(env)
    except InvalidEnvelope as exc:
        assert not case["valid"], f"refused: {exc}"
        assert [(v.field, v.rule) for v in exc.violations] == [(case["field"], case["rule"])]
        return
    assert case["valid"], f"accepted, expected {case['field']}: {case['rule']}"
    written = json.loads(env.to_json())
    for name, value in case.get("expect", {}).items():
        assert written.get(name) == value, name
    assert Envelope.parse(env.to_json()) == env


@pytest.mark.parametrize("relative", MANIFEST["envelopes"])
def test_envelope_vector(relative: str) -> None:
    case = load(relative)
    verdict(lambda: Envelope.parse(json_text(case)), case)


OBJECT_INPUTS = [
    name for name in MANIFEST["envelopes"]
    if isinstance(load(name)["input"], dict) and set(load(name)["input"]) != {"raw"}
]


@pytest.mark.parametrize("relative", OBJECT_INPUTS)
def test_envelope_vector_through_the_python_api(relative: str) -> None:
    """Parsing the decoded object (a dict) agrees with parsing the JSON text."""
    case = load(relative)
    verdict(lambda: Envelope.parse(json.loads(json_text(case))), case)


@pytest.mark.parametrize("relative", MANIFEST["entries"])
def test_entry_vector(relative: str) -> None:
    case = load(relative)
    for fields in (entry_fields(case), {k.decode(): v for k, v in entry_fields(case).items()}):
        try:
            env = decode_entry(fields)
        except MalformedEntry as exc:
            assert not case["valid"], f"refused: {exc.reason}"
            assert ENTRY_ERRORS[case["error"]] in exc.reason
            if "field" in case:
                assert [(v.field, v.rule) for v in exc.violations] == [
                    (case["field"], case["rule"])
                ]
            continue
        assert case["valid"], f"accepted, expected {case['error']}"
        assert json.loads(env.to_json()) == case["envelope"]


# ---------------------------------------------------------- payload schemas


def schema_vector_verdict(case: dict[str, Any]) -> list[dict[str, str]]:
    """The violations of the vector's payload, as the vectors write them."""
    found = payload_violations(compile_schema(case["schema"]), case["payload"])
    return [{"field": v.field, "rule": v.rule, "keyword": v.keyword} for v in found]


@pytest.mark.parametrize("relative", MANIFEST["schemas"])
def test_schema_vector_is_well_formed(relative: str) -> None:
    case = load(relative)
    assert set(case) == SCHEMA_KEYS
    assert case["name"] == Path(relative).stem
    assert case["description"]
    assert isinstance(case["payload"], dict)
    for violation in case["violations"]:
        assert set(violation) == {"field", "rule", "keyword"}
        assert violation["rule"] == SCHEMA_RULE
        assert violation["field"] == "payload" or violation["field"].startswith(
            ("payload.", "payload["))


def test_schema_vectors_cover_the_keywords_paths_and_the_format_decision() -> None:
    cases = [load(name) for name in MANIFEST["schemas"]]
    found = [v for case in cases for v in case["violations"]]
    assert {"required", "type", "additionalProperties", "enum"} <= {v["keyword"] for v in found}
    assert any(v["field"].count(".") >= 3 for v in found)  # a nested path
    assert any("[" in v["field"] for v in found)  # an array index
    assert any(len(case["violations"]) >= 4 for case in cases)  # several at once
    assert load("schemas/format_is_not_asserted.json")["violations"] == []
    assert "`format`" in README and "annotation" in README


@pytest.mark.parametrize("relative", MANIFEST["schemas"])
def test_schema_vector(relative: str) -> None:
    case = load(relative)
    assert schema_vector_verdict(case) == case["violations"]


LIMITS_SCHEMA = json.loads((ROOT.parent / "kombu_envelope" / "schemas" / "limits.schema.json")
                           .read_text(encoding="utf-8"))
LIMIT_KEYS = {"name", "description", "input", "valid", "field", "rule"}


@pytest.mark.parametrize("relative", MANIFEST["limits"])
def test_limit_vector(relative: str) -> None:
    case = load(relative)
    assert set(case) <= LIMIT_KEYS and case["name"] == Path(relative).stem
    schema_says = Draft202012Validator(LIMITS_SCHEMA).is_valid(case["input"])
    assert schema_says == case["valid"]  # the schema and the vectors agree
    if case["valid"]:
        assert parse_limit(case["input"]).as_json() == case["input"]
        return
    with pytest.raises(InvalidTaskLimit) as refused:
        parse_limit(case["input"])
    assert (refused.value.field, refused.value.rule) == (case["field"], case["rule"])
    assert case["field"] in str(refused.value)


def test_limit_vectors_cover_every_member_and_rule() -> None:
    cases = [load(name) for name in MANIFEST["limits"]]
    refused = [case for case in cases if not case["valid"]]
    assert {case["rule"] for case in refused} == {"type", "minimum", "maximum", "required",
                                                  "unknown_field"}
    assert {"concurrency", "rate", "burst", "smooth", "breaker", "breaker.failure_ratio",
            "breaker.probes"} <= {case["field"] for case in refused}
