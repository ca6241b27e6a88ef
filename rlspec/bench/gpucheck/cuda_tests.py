"""The `tests` section: the CUDA tests, each with a timeout of its own, outcome and seconds per test.

pytest runs in a child process with the events plugin (pytest_events.py); this runner watches its event file.
A test running past `per_test_s` has its process group killed, is recorded as "timeout", and pytest starts again
with every test already recorded deselected; a test whose process died under it is "crashed", the same way.
Past `total_s` the test running is "timeout" and the rest are not run: every test collected and never reached
is recorded as "not_run", so the report lists each test's outcome. pytest's output goes to `<name>.log`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PLUGIN = "rlspec.bench.gpucheck.pytest_events"
MAX_RESTARTS = 12  # a file whose collection keeps killing pytest must not loop forever


def read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group: pytest and anything it started
    except ProcessLookupError:
        pass
    proc.wait()


def one_pass(cmd: list[str], events: Path, log, env: dict, per_test_s: float, deadline: float, root: Path):
    """Run pytest once; returns (results {test: row} of this pass, returncode or None if killed, stop: bool)."""
    events.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env={**env,
                            "RLSPEC_TEST_EVENTS": str(events)}, start_new_session=True)
    results, killed_for, collected = {}, None, []
    while proc.poll() is None:
        time.sleep(0.2)
        running = _running(read_events(events))
        now = time.time()
        if running and now - running[1] > per_test_s:
            killed_for = (running[0], "timeout", now - running[1])
        elif now > deadline:
            killed_for = (running[0] if running else None, "timeout", now - running[1] if running else 0.0)
        if killed_for:
            _kill(proc)
            break
    for ev in read_events(events):
        if ev["event"] == "collected":
            collected = ev["tests"]
        if ev["event"] == "end":
            results[ev["test"]] = dict(test=ev["test"], outcome=ev["outcome"], seconds=round(ev["seconds"], 3))
    running = _running(read_events(events))
    if killed_for is None and running:  # the process died inside a test (a segfault, an abort)
        killed_for = (running[0], "crashed", time.time() - running[1])
    if killed_for and killed_for[0]:
        results[killed_for[0]] = dict(test=killed_for[0], outcome=killed_for[1], seconds=round(killed_for[2], 3))
    stop = killed_for is None or time.time() > deadline
    return results, (None if killed_for else proc.returncode), stop, collected


def _running(events: list[dict]):
    """(test, start time) of the test started and not ended, or None."""
    open_ = {}
    for ev in events:
        if ev["event"] == "collected":
            continue
        if ev["event"] == "start":
            open_[ev["test"]] = ev["t"]
        else:
            open_.pop(ev["test"], None)
    return next(iter(open_.items()), None)


def run(targets: list[str], marker: str | None, per_test_s: float, total_s: float, out: Path, root: Path,
        exclude: list[str] = (), name: str = "tests", last: list[str] = ()) -> dict:
    """Run `targets` (pytest paths or node-id prefixes) under `marker`, but not those under `exclude` (node-id
    prefixes), those under `last` after the others; the section's dict: per-test rows, counts, pytest's status; its
    log `<name>.log`."""
    from rlspec.bench.harness import child_env

    # the plugin from the rlspec running this
    env = child_env({"HF_HUB_OFFLINE": "1", "RLSPEC_TESTS_LAST": ",".join(last)}, path=[str(root)])
    base = [sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider", "-p", PLUGIN, "-q", "-rs"]
    base += ["-m", marker] if marker else []
    base += [f"--deselect={t}" for t in exclude]
    deadline = time.time() + total_s
    results, returncode, passes, collected = {}, None, 0, {}
    with open(out / f"{name}.log", "w") as log:
        while passes <= MAX_RESTARTS:
            cmd = base + [f"--deselect={t}" for t in results]
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            got, returncode, stop, seen = one_pass(cmd, out / f"{name}_events.jsonl", log, env, per_test_s,
                                                   deadline, root)
            results.update(got)
            collected.update(dict.fromkeys(seen))
            passes += 1
            if stop:
                break
    for test in collected:  # collected, never reached: the time ran out first
        results.setdefault(test, dict(test=test, outcome="not_run", seconds=0.0))
    rows = list(results.values())
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    # pytest's own status of its last pass: 5 = nothing left to run (all deselected or skipped by marker)
    ok = not any(r["outcome"] in ("failed", "error", "timeout", "crashed", "not_run") for r in rows) and \
        returncode in (0, 5)
    return dict(targets=targets, marker=marker, per_test_timeout_s=per_test_s, passes=passes,
                pytest_returncode=returncode, ok=ok, counts=counts, tests=rows)
