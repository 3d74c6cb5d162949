"""The alert rules and the Grafana dashboard of docs/monitoring/ (promtool checks the rules
and runs their unit tests; every expression names only the dispatcher's metrics)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import yaml
from support.workers import PROJECT_ROOT

MONITORING = PROJECT_ROOT / "docs" / "monitoring"

# Every series of the dispatcher's GET /metrics, histograms as their _bucket, _sum and _count.
HISTOGRAMS = ("kombu_envelope_task_run_duration_seconds",
              "kombu_envelope_task_start_delay_seconds")
METRICS = frozenset({
    "kombu_envelope_queue_backlog_entries",
    "kombu_envelope_queue_pending_entries",
    "kombu_envelope_queue_oldest_pending_age_seconds",
    "kombu_envelope_queue_delayed_tasks",
    "kombu_envelope_queue_promotion_lateness_seconds",
    "kombu_envelope_queue_dead_letters",
    "kombu_envelope_workers",
    "kombu_envelope_worker_up",
    "kombu_envelope_worker_last_seen_seconds",
    "kombu_envelope_worker_heartbeat_period_seconds",
    "kombu_envelope_tasks_succeeded_total",
    "kombu_envelope_tasks_failed_total",
    "kombu_envelope_tasks_retried_total",
    "kombu_envelope_tasks_dead_lettered_total",
    "kombu_envelope_tasks_duplicates_skipped_total",
    "kombu_envelope_scrape_duration_seconds",
    *(f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")),
})

# PromQL functions, aggregations and keywords the expressions may use, and Grafana's
# label_values() of template variables.
WORDS = frozenset({
    "sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "label_values",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_LABEL_VALUES_LABEL = re.compile(r"(label_values\([^,()]+),[^)]*\)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:e[+-]?\d+)?")
_IDENTIFIER = re.compile(r"[A-Za-z_:][\w:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression refers to: its identifiers that are neither labels,
    nor strings, durations, numbers, template variables, functions nor keywords."""
    for pattern, replacement in ((_STRING, '""'), (_MATCHERS, ""), (_RANGE, ""),
                                 (_LABEL_LIST, ""), (_LABEL_VALUES_LABEL, r"\1)"),
                                 (_VARIABLE, ""), (_NUMBER, "")):
        expr = pattern.sub(replacement, expr)
    return set(_IDENTIFIER.findall(expr)) - WORDS


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs promtool (Debian's `prometheus` package, which .ci/run installs)."""
    path = shutil.which("promtool")
    assert path is not None, "promtool is not on PATH: install it (apt-get install prometheus)"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=MONITORING)


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    assert [group["name"] for group in groups] == ["kombu-envelope"]
    return groups[0]["rules"]


def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "dashboard.json").read_text())


def dashboard_expressions(board: dict[str, Any]) -> Iterator[str]:
    """Every query of the dashboard: its panels' targets and its query variables."""
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]["query"]


def test_metric_names_finds_a_renamed_metric_and_ignores_labels_and_functions() -> None:
    expr = ('histogram_quantile(0.99, sum by (queue, le) (rate('
            'kombu_envelope_task_start_delay_seconds_bucket{queue=~"$queue",le!="1e3"}'
            '[$__rate_interval]))) / on (queue) group_left kombu_envelope_tasks_faild_total > 1e-3')
    assert metric_names(expr) == {"kombu_envelope_task_start_delay_seconds_bucket",
                                  "kombu_envelope_tasks_faild_total"}
    assert metric_names("label_values(kombu_envelope_workers, language)") == {
        "kombu_envelope_workers"}


def test_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_for_severity_summary_description_and_known_metrics() -> None:
    found = rules()
    assert len(found) == 5
    for rule in found:
        assert rule["alert"].startswith("KombuEnvelope"), rule
        assert rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= METRICS, f"{rule['alert']}: unknown metrics {names - METRICS}"


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    cases: dict[str, list[list[Any]]] = {}
    for test in tests:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], []).append(case["exp_alerts"])
    assert set(cases) == {rule["alert"] for rule in rules()}
    for name, expected in cases.items():
        assert [] in expected, f"{name}: no case where it stays quiet"
        firing = [alert for alerts in expected for alert in alerts]
        assert firing, f"{name}: no case where it fires"
        for alert in firing:
            assert set(alert["exp_annotations"]) == {"summary", "description"}, name


def test_dashboard_variables_and_panels() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert set(variables) == {"datasource", "queue", "language"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("queue", "language"):
        assert variables[name]["type"] == "query"
        assert variables[name]["query"]["query"].startswith("label_values(")
        assert variables[name]["query"]["query"].endswith(f", {name})")
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_dashboard_expressions_name_only_the_dispatcher_metrics() -> None:
    used: set[str] = set()
    for expr in dashboard_expressions(dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= METRICS, f"unknown metrics {names - METRICS} in {expr!r}"
        used |= names
    missing = METRICS - used - {f"{name}_{suffix}" for name in HISTOGRAMS
                                for suffix in ("sum", "count")}
    assert not missing, f"metrics without a panel: {missing}"

