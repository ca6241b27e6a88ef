"""A pytest plugin (`-p rlspec.bench.gpucheck.pytest_events`) that appends one JSON line per test to the file
$RLSPEC_TEST_EVENTS: {"event": "start", "test", "t"} when a test begins and {"event": "end", "test",
"outcome", "seconds"} when its setup, call and teardown are done; {"event": "collected", "tests": [...]} once the
tests to run are known (a test never reached is then recorded as "not_run"); the tests $RLSPEC_TESTS_LAST names run
last. The device check's test runner
(cuda_tests.py) watches the file to time each test out from outside (pytest-timeout is not on the GPU machine,
and a test stuck in a CUDA call ignores signals); stdlib only."""
from __future__ import annotations

import json
import os
import time

_outcomes: dict[str, str] = {}
_starts: dict[str, float] = {}


def _write(event: dict) -> None:
    path = os.environ.get("RLSPEC_TEST_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def pytest_collection_modifyitems(config, items):
    """The tests under the node-id prefixes of $RLSPEC_TESTS_LAST (comma-separated) run after the others: what a
    section's time may run out for."""
    last = [p for p in os.environ.get("RLSPEC_TESTS_LAST", "").split(",") if p]
    if last:
        items[:] = sorted(items, key=lambda item: any(item.nodeid.startswith(p) for p in last))  # stable


def pytest_collection_finish(session):
    _write({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _starts[nodeid] = time.time()
    _write({"event": "start", "test": nodeid, "t": _starts[nodeid]})


def pytest_runtest_logreport(report):
    """The test's outcome: a failed phase wins (a teardown failure after a pass is an error), then a skip."""
    prior = _outcomes.get(report.nodeid, "passed")
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        _outcomes[report.nodeid] = prior if prior in ("failed", "error") else outcome
    elif report.skipped and prior == "passed":
        _outcomes[report.nodeid] = "skipped"
    else:
        _outcomes.setdefault(report.nodeid, prior)


def pytest_runtest_logfinish(nodeid, location):
    _write({"event": "end", "test": nodeid, "outcome": _outcomes.pop(nodeid, "passed"),
            "seconds": time.time() - _starts.pop(nodeid, time.time())})
