"""``python -m bench --quick`` runs every scenario and writes both reports.

Only the shape of the reports is checked, never a figure: timings depend on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("publish", "consume", "bulk", "celery", "paced", "latency", "delayed",
             "countdown", "memory", "recovery", "limits", "dispatcher")
#: Scenarios that measure celery-redis-plus whenever it is importable.
PLUS_SCENARIOS = ("celery", "paced", "countdown", "memory")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_reports_every_scenario(tmp_path: Path) -> None:
    out_md, out_json = tmp_path / "benchmarks.md", tmp_path / "benchmarks.json"
    out_md.write_text("# Benchmarks\n\nHand-written analysis.\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "BENCH_AMQP_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--quiet",
         "--out-md", str(out_md), "--out-json", str(out_json)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]

    report = json.loads(out_json.read_text(encoding="utf-8"))
    assert [s["key"] for s in report["scenarios"]] == list(SCENARIOS)
    for scenario in report["scenarios"]:
        assert scenario["error"] is None, scenario["error"]
        assert scenario["measures"], scenario["key"]
        for measure in scenario["measures"]:
            assert measure["samples"], (scenario["key"], measure["label"])
    for field in ("cpu_model", "cpu_count", "python", "redis_server", "kombu", "celery",
                  "redis_py", "date"):
        assert report["machine"][field], field
    assert "BENCH_AMQP_URL" in report["config"]["amqp_note"]
    plus = report["machine"]["celery_redis_plus"]
    by_key = {s["key"]: s for s in report["scenarios"]}
    for key in PLUS_SCENARIOS:
        transports = {m["transport"] for m in by_key[key]["measures"]}
        assert ("plus" in transports) == bool(plus), (key, transports)
    assert bool(plus) != bool(report["config"]["plus_note"])
    redis_transports = {"envelope", "redis"} | ({"plus"} if plus else set())
    for key in ("celery", "paced"):
        cpu = [m for m in by_key[key]["measures"] if m["unit"] == "µs"]
        assert {m["transport"] for m in cpu} == redis_transports, key
        assert any("envelope / stock" in r["label"] and "CPU" in r["label"]
                   for r in by_key[key]["ratios"])

    text = out_md.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\nHand-written analysis.\n")
    assert text.count("<!-- bench:results:begin -->") == 1
    assert text.count("<!-- bench:results:end -->") == 1
    for key in SCENARIOS:
        assert f"(`{key}`)" in text, key
    assert "RabbitMQ | skipped" in text
    assert (f"celery-redis-plus | {plus}" if plus else "celery-redis-plus | skipped: ") in text
