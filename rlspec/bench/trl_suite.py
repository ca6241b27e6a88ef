"""TRL compatibility: TRL's own trainer tests, plain vs the rlspec drop-in. `--trainer grpo` (default): TRL's
tests/test_grpo_trainer.py against SpecGRPOTrainer; `--trainer rloo`: tests/test_rloo_trainer.py against
SpecRLOOTrainer.

Runs the test module twice with pytest, offline:
  plain  as written (trl.GRPOTrainer / trl.RLOOTrainer);
  spec   the name `GRPOTrainer` / `RLOOTrainer` in the test module bound to a thin subclass of the rlspec class that
         records, per test, its generations and whether its rollouts came back from rlspec's engine (the pytest
         plugin rlspec/bench/trl_plugin.py).
The bar: no test passing on plain fails on spec, and at least two thirds of the spec-passing tests that generate
sample through the engine (for GRPO also at least 68 of them). The last line printed is the result in one line.

TRL's tests are passed in (CI has no network; TRL's test code is never vendored here):
    git clone https://github.com/huggingface/trl && git -C trl checkout v1.16.0   # the installed trl version
    python -m rlspec.bench trl-suite --trl-tests trl/tests
`--trl-tests` is copied into --work; nothing in it is edited. Before the runs the tiny models and datasets the
test file names are built offline (rlspec/bench/trl_fixtures.py); repo ids without a recipe (vision-language,
remote-code models, image datasets) are listed, and a test failing because it needs one counts as skipped in both
arms. The report: per-test outcome of both arms, whether each spec test sampled through the engine, counts, wall
times, and the tests passing on plain but failing on spec with the first line of the error. docs/trl_suite.md.

    python -m rlspec.bench trl-suite --trl-tests /tmp/trl_tests -k "TestGRPOTrainer and loss_type"   # a subset
    python -m rlspec.bench trl-suite --trainer rloo --trl-tests /tmp/trl_tests   # bench_out/trl_suite_rloo.json
    python -m rlspec.bench trl-suite --report-only                                                   # re-print
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.harness import ROOT as REPO
from rlspec.bench.trl_fixtures import build_fixtures
from rlspec.bench.trl_results import (
    SUITES, counts, format_summary, group_by_cause, nodeid_key, parse_engine_log, parse_junit, per_test_table,
    reclassify_unbuilt, regressions, summarize, test_sources)

NAME = "trl-suite"
HELP = ("TRL's own GRPOTrainer (or --trainer rloo: RLOOTrainer) tests, plain vs the rlspec drop-in: no regression, "
        "tests sampling through the engine")
# --smoke: a two-test stand-in for TRL's test file, run through both arms and the plugin
SMOKE_TESTS = '''from trl import {trl_class}


def test_trainer_is_importable():
    assert {trl_class}.__name__ in ("{trl_class}", "{spec_class}UnderTest")


def test_unbuilt_model_is_skipped():
    raise OSError("trl-internal-testing/tiny-VisionOnly is not built offline")
'''


def add_arguments(p) -> None:
    p.add_argument("--trainer", choices=sorted(SUITES), default="grpo",
                   help="whose tests: grpo (test_grpo_trainer.py, SpecGRPOTrainer) or rloo (test_rloo_trainer.py, "
                        "SpecRLOOTrainer); rloo's report goes to bench_out/trl_suite_rloo.json")
    p.add_argument("--trl-tests", type=Path, help="a checkout of TRL's tests/ directory for the installed trl version")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch directory (tiny models, datasets, logs); reused across runs (default "
                        "/tmp/rlspec_trl_suite, /tmp/rlspec_trl_suite_rloo for rloo)")
    p.add_argument("--arms", default="plain,spec", help="comma-separated: plain, spec")
    p.add_argument("-k", "--select", default=None, help="pytest -k expression: run a subset")
    p.add_argument("--timeout-s", type=int, default=300, help="per-test limit (0: none)")
    p.add_argument("--jobs", type=int, default=2,
                   help="pytest processes at a time; each arm's tests are split into this many shards")
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per pytest process")
    p.add_argument("--rebuild", action="store_true", help="rebuild the tiny models and datasets")
    p.add_argument("--note", default="", help="free text recorded in the JSON (e.g. which rlspec tree ran)")
    p.add_argument("--reuse-results", action="store_true",
                   help="do not run pytest: rebuild the report from the JUnit XML and engine logs left in --work")
    p.add_argument("--report-only", action="store_true", help="print the summary of an existing --out and exit")
    p.add_argument("--pytest-arg", action="append", default=[], help="extra argument passed to pytest (repeatable)")


def _smoke_tests(args) -> None:
    """A stand-in tests/ directory (two tests, one needing a model not built offline) and a scratch --work."""
    base = Path(args.out).with_suffix("")
    args.trl_tests, args.work = base.parent / (base.name + "_tests"), base.parent / (base.name + "_work")
    args.trl_tests.mkdir(parents=True, exist_ok=True)
    (args.trl_tests / SUITES[args.trainer]["test_file"]).write_text(SMOKE_TESTS.format(**SUITES[args.trainer]))


def _trainer_defaults(args) -> None:
    """--work and --out for a trainer other than grpo, unless given (grpo keeps the historical names)."""
    suffix = "" if args.trainer == "grpo" else f"_{args.trainer}"
    if args.work is None:
        args.work = Path(f"/tmp/rlspec_trl_suite{suffix}")
    default_out = harness.default_out(argparse.Namespace(smoke=args.smoke), NAME)
    if suffix and args.out == default_out:
        args.out = default_out.removesuffix(".json") + f"{suffix}.json"


def run(args) -> dict:
    _trainer_defaults(args)
    test_file = SUITES[args.trainer]["test_file"]
    if args.report_only:
        print(format_summary(json.loads(Path(args.out).read_text())))
        raise SystemExit(0)
    if args.smoke:
        _smoke_tests(args)
        args.jobs = 1  # one pytest process per arm
    if args.trl_tests is None or not (args.trl_tests / test_file).is_file():
        raise SystemExit(f"--trl-tests must be a TRL tests/ checkout containing {test_file} (see --help)")
    import trl

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tests_dir = work / "trl_tests"  # a copy: TRL's checkout is never written to; "trl_tests" avoids a clash with ours
    shutil.rmtree(tests_dir, ignore_errors=True)
    shutil.copytree(args.trl_tests, tests_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    t0 = time.time()
    fixtures = build_fixtures(tests_dir / test_file, work, rebuild=args.rebuild)
    fixtures_file = work / "fixtures.json"
    fixtures_file.write_text(json.dumps(fixtures, indent=1))
    build_s = time.time() - t0
    print(f"[trl_suite] fixtures in {build_s:.0f}s: {len(fixtures['models'])} models, "
          f"{sum(len(v) for v in fixtures['datasets'].values())} dataset configs, {len(fixtures['unbuilt'])} not built",
          flush=True)
    if args.reuse_results:  # summarise the JUnit XML / engine logs an earlier run left in --work
        results, engines = merge_outputs(arms, work, None)
        previous = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
        wall_doc = previous.get("wall_s", {})
    else:
        results, engines, walls = run_arms(arms, tests_dir / test_file, work, fixtures_file, args.select,
                                           args.timeout_s, args.pytest_arg, args.jobs, args.threads, args.trainer)
        wall_doc = {**{a: round(w, 1) for a, w in walls.items()}, "fixtures": round(build_s, 1),
                    "total": round(time.time() - t0, 1)}
    return report(args, arms, tests_dir, fixtures, results, engines, wall_doc, trl.__version__)


def report(args, arms, tests_dir, fixtures, results, engines, wall_doc, trl_version) -> dict:
    sources = test_sources(tests_dir / SUITES[args.trainer]["test_file"])
    for arm in arms:
        n = reclassify_unbuilt(results[arm], sources, fixtures["unbuilt"])
        print(f"[trl_suite] {arm}: {n} failures needing a model/dataset not built offline counted as skipped", flush=True)
    plain, spec = results.get("plain"), results.get("spec")
    engine = engines.get("spec", {})
    regs = regressions(plain, spec) if plain is not None and spec is not None else []
    doc = {"trainer": args.trainer, "trl_version": trl_version, "trl_tests_source": str(args.trl_tests.resolve()),
           "trl_tests_version_note": _source_note(args.trl_tests), "note": args.note, "select": args.select,
           "arms": arms, "jobs": args.jobs, "threads": args.threads,
           "test_time_s": {a: round(sum(r["time_s"] for r in res.values()), 1) for a, res in results.items()},
           "wall_s": wall_doc, "summary": summarize(plain, spec, engine, args.trainer), "regressions": regs,
           "regressions_by_cause": group_by_cause(regs), "built_models": fixtures["models"],
           "built_datasets": {k: sorted(v) for k, v in fixtures["datasets"].items()}, "unbuilt": fixtures["unbuilt"],
           "tests": per_test_table(plain, spec, engine)}
    print(format_summary(doc))
    return doc


def _source_note(tests_dir: Path) -> str:
    """Where the tests came from, when the checkout can tell (git describe / commit)."""
    try:
        top = subprocess.run(["git", "-C", str(tests_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0:
            d = subprocess.run(["git", "-C", str(tests_dir), "describe", "--tags", "--always"], capture_output=True,
                               text=True, timeout=10)
            return f"git {d.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    marker = tests_dir / "TRL_SOURCE"
    return marker.read_text().strip() if marker.is_file() else "unknown (not a git checkout)"


# ------------------------------------------------------------------------------------------------- running
def _env(arm: str, work: Path, fixtures_file: Path, engine_log: Path, timeout_s: int, threads: int,
         trainer: str = "grpo") -> dict:
    env = dict(os.environ)
    env.update({
        "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "datasets_cache"),
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
        # tiny models: intra-op threads only add contention (measured 80 s -> 26 s per test on 2 shared cores)
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "RLSPEC_TRL_ARM": arm, "RLSPEC_TRL_TRAINER": trainer, "RLSPEC_TRL_FIXTURES": str(fixtures_file), "RLSPEC_TRL_ENGINE_LOG": str(engine_log),
        "RLSPEC_TRL_TIMEOUT_S": str(timeout_s),
        "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def _pytest_cmd(test_file: Path, junit: Path | None, select: str | None, nodeids: list[str] | None,
                extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *(nodeids or [str(test_file)]), "-p", "rlspec.bench.trl_plugin",
           "-p", "no:cacheprovider", "-q", "-rN", "--tb=line", "-o", "junit_logging=no", "-o", "addopts=",
           f"--rootdir={test_file.parent.parent}"]  # addopts: a --work inside a checkout must not add its own
    if junit is not None:
        cmd.append(f"--junitxml={junit}")
    if select and not nodeids:
        cmd += ["-k", select]
    return cmd + extra


def collect(test_file: Path, work: Path, fixtures_file: Path, select: str | None, threads: int,
            trainer: str = "grpo") -> list[str]:
    """The selected test nodeids, in file order (pytest --collect-only with the plugin loaded)."""
    cmd = _pytest_cmd(test_file, None, select, None, ["--collect-only"])
    env = _env("plain", work, fixtures_file, work / "engine_collect.jsonl", 0, threads, trainer)
    out = subprocess.run(cmd, cwd=str(work), env=env, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"[trl_suite] collection found no tests:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def run_arms(arms: list[str], test_file: Path, work: Path, fixtures_file: Path, select: str | None, timeout_s: int,
             extra_pytest: list[str], jobs: int, threads: int, trainer: str = "grpo") -> tuple[dict, dict, dict]:
    """Run every arm over the selected tests, split into `jobs` shards per arm, at most `jobs` pytest processes at
    a time (shards of the arms interleaved). Returns ({arm: results}, {arm: engine records}, {arm: wall_s})."""
    nodeids = collect(test_file, work, fixtures_file, select, threads, trainer)
    shards = [nodeids[i::jobs] for i in range(jobs)] if jobs > 1 else [nodeids]
    tasks = [(arm, i, shard) for i, shard in enumerate(shards) if shard for arm in arms]
    print(f"[trl_suite] {len(nodeids)} tests selected; {len(tasks)} pytest processes ({jobs} at a time)", flush=True)
    for f in work.glob("junit_*.xml"):
        f.unlink()
    for f in work.glob("engine_*.jsonl"):
        f.unlink()
    running: list[tuple] = []
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    pending = list(tasks)
    while pending or running:
        while pending and len(running) < jobs:
            arm, i, shard = pending.pop(0)
            junit, engine_log = work / f"junit_{arm}_{i}.xml", work / f"engine_{arm}_{i}.jsonl"
            cmd = _pytest_cmd(test_file, junit, select, shard if jobs > 1 else None, extra_pytest)
            log = open(work / f"pytest_{arm}_{i}.log", "w")
            print(f"[trl_suite] start {arm} shard {i} ({len(shard)} tests)", flush=True)
            proc = subprocess.Popen(cmd, cwd=str(work), env=_env(arm, work, fixtures_file, engine_log, timeout_s, threads, trainer),
                                    stdout=log, stderr=subprocess.STDOUT)
            started.setdefault(arm, time.time())
            running.append((proc, arm, i, log, time.time()))
        time.sleep(0.2)  # a finished shard's slot is refilled at once (a smoke arm is seconds)
        for item in list(running):
            proc, arm, i, log, t0 = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                finished[arm] = time.time()
                print(f"[trl_suite] done {arm} shard {i}: rc={proc.returncode} in {time.time() - t0:.0f}s", flush=True)
    walls = {arm: round(finished.get(arm, time.time()) - started.get(arm, time.time()), 1) for arm in arms}
    results, engines = merge_outputs(arms, work, nodeids)
    return results, engines, walls


def merge_outputs(arms: list[str], work: Path, nodeids: list[str] | None) -> tuple[dict, dict]:
    """Each arm's results and engine records, merged over its shards' JUnit XML and engine logs under `work`."""
    results, engines = {}, {}
    for arm in arms:
        results[arm], engines[arm] = {}, {}
        for junit in sorted(work.glob(f"junit_{arm}_*.xml")):
            results[arm].update(parse_junit(junit.read_text()))
        for log in sorted(work.glob(f"engine_{arm}_*.jsonl")):
            engines[arm].update(parse_engine_log(log.read_text()))
        # a shard that died (crash, OOM) leaves its tests without a JUnit entry: count them as errors
        for nodeid in nodeids or []:
            key = nodeid_key(nodeid)
            if key not in results[arm]:
                results[arm][key] = {"outcome": "error", "message": "no result: the pytest process died", "time_s": 0.0}
        print(f"[trl_suite] {arm}: {counts(results[arm])}", flush=True)
    return results, engines

