"""Celery's own integration suite on ``envelope://`` beside ``redis://`` (bench.celery_suite).

The long test runs ``t/integration/test_tasks.py`` of the installed Celery (fetched from
PyPI on first use, then cached) on both brokers at once, each on its own private
redis-server, and holds ``envelope://`` to what the docs promise: at least as many tests
pass as on the stock broker, and every test failing on ``envelope://`` only is explained
in docs/celery-compatibility.md. The short tests check the harness's own parts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.celery_suite.explained import DOC, ExplanationError, explanations
from bench.celery_suite.junit import CaseResult, Outcome, read_junit
from bench.celery_suite.rerun import rerun_differences, with_session_worker
from bench.celery_suite.run import BROKERS, SUITES, BrokerRun, node_id, run_broker

ROOT = Path(__file__).resolve().parent.parent
TASKS = SUITES["tasks"]

#: Both brokers run at once, so the test takes as long as the slower one. Measured on
#: 2 cores: redis:// 177 s; envelope:// 388 s while 12 of its tests fail (each failure
#: waits for its result up to the test's own timeout or the 60 s cap); 178 s with a
#: promoter added to Celery's test worker and the execution shell turned off.
SUITE_TIMEOUT_S = 1500


@pytest.mark.slow
@pytest.mark.timeout(SUITE_TIMEOUT_S + 60)
def test_celery_task_suite_passes_on_envelope_as_on_redis(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.celery_suite", "--suite", "tasks", "--quiet",
         "--json", str(report_path), "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S,
    )
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text(encoding="utf-8"))
    stock, envelope = report["runs"]["redis"], report["runs"]["envelope"]
    assert stock["error"] is None and envelope["error"] is None
    # The same tests ran on both, and the stock broker passes nearly all of them: a
    # harness that ran nothing, or broke every test, would compare 0 with 0.
    assert set(stock["results"]) == set(envelope["results"])
    assert stock["counts"]["passed"] >= 0.8 * len(stock["results"]) > 0, stock["counts"]

    table = proc.stdout
    assert envelope["counts"]["passed"] >= stock["counts"]["passed"], table
    assert report["unexplained"] == [], table
    assert report["problems"] == [], table


def test_every_documented_difference_has_an_explanation() -> None:
    found = explanations(DOC)
    for test_id, why in found.items():
        assert test_id.startswith("test_") and "::" in test_id, test_id
        assert len(why) > 40, f"{test_id}: {why!r} explains nothing"


def test_a_row_without_an_explanation_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(textwrap.dedent("""\
        <!-- celery-suite:differences:begin -->
        | test | `redis://` | `envelope://` | why |
        | --- | --- | --- | --- |
        | `test_tasks.py::test_tasks::test_fail` | passed | failed |  |
        <!-- celery-suite:differences:end -->
        """), encoding="utf-8")
    with pytest.raises(ExplanationError, match="test_fail"):
        explanations(doc)


@pytest.mark.timeout(60)
def test_plugin_caps_long_timeout_marks_and_junit_gives_each_outcome(tmp_path: Path) -> None:
    """A test marked with a 300 s timeout that hangs fails after --timeout, and every
    outcome pytest can report is read back from the JUnit XML."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "pkg" / "test_sample.py").write_text(textwrap.dedent("""\
        import threading

        import pytest

        @pytest.mark.timeout(300)
        def test_hangs():
            threading.Event().wait()

        def test_passes():
            pass

        class test_group:
            def test_fails(self):
                assert False, "expected"

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        @pytest.mark.xfail(reason="known")
        def test_xfails():
            assert False

        @pytest.fixture
        def broken():
            raise RuntimeError("no fixture")

        def test_errors(broken):
            pass
        """), encoding="utf-8")
    junit = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "pkg/test_sample.py", "-p", "bench.celery_suite.plugin",
         "-p", "no:cacheprovider", "--timeout=2", f"--junitxml={junit}",
         "-o", "python_classes=test_*", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=50,
        env={**_env_without_pytest(), "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = read_junit(junit, ["pkg.test_sample"])
    assert {test_id: r.outcome for test_id, r in results.items()} == {
        "test_sample.py::test_hangs": Outcome.FAILED,
        "test_sample.py::test_passes": Outcome.PASSED,
        "test_sample.py::test_group::test_fails": Outcome.FAILED,
        "test_sample.py::test_skipped": Outcome.SKIPPED,
        "test_sample.py::test_xfails": Outcome.XFAILED,
        "test_sample.py::test_errors": Outcome.ERROR,
    }
    assert "Timeout" in results["test_sample.py::test_hangs"].message
    assert results["test_sample.py::test_hangs"].seconds < 30


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("broker", "imported"), [("envelope://127.0.0.1:1/1", True),
                                                  ("redis://127.0.0.1:1/1", False)])
def test_plugin_imports_celery_ext_before_conftests_for_envelope_only(
        tmp_path: Path, broker: str, imported: bool) -> None:
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        "IMPORTED = 'celery_ext' in sys.modules\n", encoding="utf-8")
    (tmp_path / "test_it.py").write_text(textwrap.dedent(f"""\
        from conftest import IMPORTED

        def test_imported():
            assert IMPORTED is {imported}
        """), encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_it.py", "-p", "bench.celery_suite.plugin",
         "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=50,
        env={**_env_without_pytest(), "PYTHONPATH": str(ROOT), "TEST_BROKER": broker},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _env_without_pytest() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_CURRENT_TEST")}


def test_only_one_broker_failures_are_run_again_and_a_pass_on_rerun_counts() -> None:
    def run_of(name: str, outcomes: dict[str, Outcome]) -> BrokerRun:
        return BrokerRun(BROKERS[name], (TASKS,), results={
            test_id: CaseResult(test_id, outcome, 1.0) for test_id, outcome in outcomes.items()})

    stock = run_of("redis", {"a": Outcome.FAILED, "b": Outcome.PASSED, "c": Outcome.ERROR,
                             "d": Outcome.SKIPPED})
    envelope = run_of("envelope", {"a": Outcome.PASSED, "b": Outcome.FAILED, "c": Outcome.FAILED,
                                   "d": Outcome.FAILED})
    asked: list[tuple[str, tuple[str, ...], int]] = []

    def rerun(run: BrokerRun, tests: tuple[str, ...], attempt: int) -> BrokerRun:
        asked.append((run.broker.name, tests, attempt))
        again = {"redis": {"a": Outcome.FAILED}, "envelope": {"b": Outcome.PASSED,
                                                              "d": Outcome.FAILED}}
        return run_of(run.broker.name, {test_id: outcome for test_id, outcome
                                        in again[run.broker.name].items() if test_id in tests})

    passed = rerun_differences(stock, envelope, rerun, reruns=2)
    assert passed == {"redis": [], "envelope": ["b"]}
    # c fails on both and is never run again; a and d fail twice on their broker.
    assert sorted(asked) == [("envelope", ("b", "d"), 2), ("envelope", ("d",), 3),
                             ("redis", ("a",), 2), ("redis", ("a",), 3)]
    assert envelope.results["b"].outcome is Outcome.PASSED
    assert envelope.results["b"].attempt == 2
    assert stock.results["a"].outcome is Outcome.FAILED


def test_no_reruns_on_a_broker_with_more_one_broker_failures_than_the_limit() -> None:
    stock = BrokerRun(BROKERS["redis"], (TASKS,), results={
        t: CaseResult(t, Outcome.PASSED, 1.0) for t in "abc"})
    envelope = BrokerRun(BROKERS["envelope"], (TASKS,), results={
        t: CaseResult(t, Outcome.FAILED, 1.0) for t in "abc"})

    def rerun(run: BrokerRun, tests: tuple[str, ...], attempt: int) -> BrokerRun:
        raise AssertionError(f"{tests} run again")

    assert rerun_differences(stock, envelope, rerun, reruns=1, max_tests=2) == \
        {"redis": [], "envelope": []}


def test_a_rerun_of_a_test_that_needs_the_session_worker_starts_it_first() -> None:
    needs, fail = ("test_tasks.py::test_trace_log_arguments::test_task_success",
                   "test_tasks.py::test_tasks::test_fail")
    assert with_session_worker((needs, fail)) == \
        ("test_tasks.py::test_tasks::test_basic_task", needs, fail)
    assert with_session_worker((fail,)) == (fail,)


def test_node_ids_of_test_ids() -> None:
    assert node_id((TASKS,), "test_tasks.py::test_tasks::test_fail") == \
        "t/integration/test_tasks.py::test_tasks::test_fail"
    with pytest.raises(ValueError):
        node_id((TASKS,), "test_canvas.py::test_chain::test_simple_chain")


@pytest.mark.timeout(120)
def test_a_run_past_its_time_limit_is_interrupted_and_keeps_what_finished(
        tmp_path: Path) -> None:
    tests_dir = tmp_path / "tree"
    (tests_dir / "t" / "integration").mkdir(parents=True)
    for package in ("t", "t/integration"):
        (tests_dir / package / "__init__.py").write_text("", encoding="utf-8")
    (tests_dir / "t" / "integration" / "test_slow.py").write_text(textwrap.dedent("""\
        import os
        import threading

        def test_quick():
            assert os.environ["TEST_BROKER"].startswith("envelope://127.0.0.1:")

        def test_hangs():
            threading.Event().wait()
        """), encoding="utf-8")
    # 20 s: on a loaded machine the quick test's worker and pytest start took more than 8 s.
    run = run_broker(BROKERS["envelope"], tests_dir, ("t/integration/test_slow.py",),
                     tmp_path / "out", timeout_s=100, run_timeout_s=20)
    assert run.error is not None and "did not finish" in run.error
    assert {t: r.outcome for t, r in run.results.items()} == \
        {"test_slow.py::test_quick": Outcome.PASSED}
    assert run.seconds < 8 + 60
