"""Second attempts for the tests that fail on one broker only.

Celery's own suite reruns its tests marked ``flaky`` up to five times
(pytest-rerunfailures); the harness's main pass gives no test a rerun, so a race in a test
shows up as a difference between the brokers. Each test failing on one broker and not on
the other is therefore run again on that broker, in a new pytest session holding only such
tests, up to ``reruns`` times. A pass then counts, as the attempt it came on; a rerun never
turns a pass into a failure, and a test failing on both brokers is not run again. When more
than ``max_tests`` tests fail on one broker only, that broker's are not run again: so many
differences are not races, and rerunning them would only double the time they take.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from bench.celery_suite.run import BrokerRun

__all__ = ["failing_only_here", "rerun_differences"]

#: Runs the given tests again on the broker of a run, for the given attempt.
Rerunner = Callable[[BrokerRun, tuple[str, ...], int], BrokerRun]

#: Tests that use Celery's session worker without starting it (an earlier test of the
#: session did), and a test that starts it: a rerun of the former runs the latter first,
#: or they wait for a worker that never comes (its own outcome counts for nothing).
NEEDS_SESSION_WORKER = "test_tasks.py::test_trace_log_arguments::"
STARTS_SESSION_WORKER = "test_tasks.py::test_tasks::test_basic_task"


def with_session_worker(tests: tuple[str, ...]) -> tuple[str, ...]:
    """``tests``, after a test that starts the session worker when one of them needs it."""
    if any(test.startswith(NEEDS_SESSION_WORKER) for test in tests) \
            and STARTS_SESSION_WORKER not in tests:
        return (STARTS_SESSION_WORKER, *tests)
    return tests


def failing_only_here(run: BrokerRun, other: BrokerRun) -> tuple[str, ...]:
    """Tests of ``run`` that failed there and passed, or were skipped, in ``other``."""
    found = []
    for test_id, result in run.results.items():
        theirs = other.results.get(test_id)
        if result.outcome.failing and theirs is not None and not theirs.outcome.failing:
            found.append(test_id)
    return tuple(found)


def rerun_differences(stock: BrokerRun, envelope: BrokerRun, rerun: Rerunner,
                      reruns: int, max_tests: int = 5) -> dict[str, list[str]]:
    """Run the one-broker failures again (both brokers at once); return, by broker name,
    the tests that passed on a rerun."""
    passed: dict[str, list[str]] = {stock.broker.name: [], envelope.broker.name: []}
    for attempt in range(2, reruns + 2):
        wanted = [(run, failing_only_here(run, other))
                  for run, other in ((stock, envelope), (envelope, stock))]
        wanted = [(run, tests) for run, tests in wanted if 0 < len(tests) <= max_tests]
        if not wanted:
            break
        with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
            futures = [(run, pool.submit(rerun, run, with_session_worker(tests), attempt))
                       for run, tests in wanted]
            for run, future in futures:
                passed[run.broker.name] += run.take_passes(future.result(), attempt)
    return passed
