"""The device check (`make gpu-check`) and its CPU rehearsal (`make gpu-rehearsal`, --smoke): one prepared run
for one GPU with the software a GPU machine has (its own python3 with a CUDA torch; no registry, no hub, no
vLLM), writing one JSON report and a log per section to --out as each section completes, so a run cut off still
returns what it did. It runs from a checkout or an installed wheel (output under the working directory's
bench_out/; the commit and dirty state of the tree it ran, "unknown" outside a checkout).

Sections, in order; the core (tests, plain, spec_costs) is limited to 300 s, the whole check to 600 s (a section
that ends early leaves its seconds to the ones after it):
  tests       the CUDA smoke subset (parity, law, graphs, paging), each test in a pytest child with a timeout
  plain       engine vs transformers, SmolLM2-135M and Qwen2.5-7B shapes, batch 1/8/32/128: rollouts (every key
              captured first, median of three), graph step ms beside its bandwidth limit
  spec_costs  7B shape: verify of T = 2..8 tokens (chains, trees) relative to a plain step per batch bucket;
              one EAGLE-3 draft level for the whole batch, ms and over a plain step
  profile     7B shape, batch 1 and 128: top kernels, host ops, host gap per decode step (torch.profiler)
  contexts    7B shape: the plain step at 256, 2k and 8k cached positions, beside its bandwidth limit
  oracle      7B shape, T = 0: rollouts with a drafter of known per-token acceptance a (0.5/0.7/0.9, in rotated
              order), batch 1/8/32, vs plain decoding: the check of docs/gpu.md's predicted speedup
  e2e         GRPO steps, SpecGRPOTrainer (plain; oracle drafter at a = 0.7) against trl.GRPOTrainer: seconds
              per step and per phase (skipped, and why, where TRL is not importable)
  tests_rest  every other CUDA test
An extra, run only when named (--sections compiled): the plain step with eager and with compiled layers (7B).
Beside the tests a compile-ahead child runs the measuring sections' light form, for the kernels they will compile
(gpucheck/ahead.py), and is stopped when the tests end.
Every section but the tests runs in a child process with a timeout (a hung CUDA call cannot take the report
down; the rehearsal runs its measuring sections in one child); every CUDA test's outcome is a row of report.json.

    python -m rlspec.bench.gpu                      # on the GPU machine (make gpu-check): bench_out/gpu/report.json
    python -m rlspec.bench gpu                      # the same through the harness: bench_out/gpu.json + bench_out/gpu/
    python -m rlspec.bench.gpu --smoke              # the rehearsal, tiny shapes on CPU: bench_out/gpu_rehearsal/
    python -m rlspec.bench.gpu --sections plain oracle --out /tmp/gpu
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.gpucheck import ahead, aims, predict, presets
from rlspec.bench.gpucheck.carry import CARRY  # what a GPU machine gets carried: tokenizer/, site/ (make gpu-carry)

NAME = "gpu"
HELP = ("the device check: CUDA tests, plain decode, speculation costs, profile, long contexts, oracle rollouts, "
        "GRPO end to end (--smoke: CPU)")
ROOT = harness.ROOT  # where rlspec is imported from: its tests/ are there in a checkout
SECTIONS = presets.SECTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="the rehearsal: tiny shapes on the CPU, the same sections and report, in ~2 minutes")
    parser.add_argument("--out", default=None,
                        help="report folder (default bench_out/gpu; with --smoke bench_out/gpu_rehearsal); a path "
                             "X.json names the report itself, the logs going to the folder X")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS + presets.EXTRAS,
                        help=f"sections to run (default: the check; extras: {', '.join(presets.EXTRAS)})")
    parser.add_argument("--tokenizer", default=None,
                        help=f"tokenizer directory for the e2e section (default {CARRY}/tokenizer, "
                             "else the embedded model's in the rlspec cache)")
    parser.add_argument("--site", default=None,
                        help=f"extra import path for the sections (carried trl/datasets; default "
                             f"{CARRY}/site where it exists)")
    parser.add_argument("--per-test-timeout-s", type=float, default=None, help="one CUDA test's limit")
    parser.add_argument("--no-ahead", action="store_true",
                        help="run the CUDA tests alone: no child compiling the later sections' kernels beside them")
    parser.add_argument("--timeout-s", nargs="*", default=None, metavar="SECTION=S",
                        help="override section limits, e.g. tests=120 oracle=200 (seconds)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: run this section here
    parser.add_argument("--ahead", action="store_true", help=argparse.SUPPRESS)  # ... in its compile-ahead form


def paths(args) -> tuple[Path, Path]:
    """(report file, folder for logs and section files): DIR/report.json and DIR, or for a report path X.json
    (what `python -m rlspec.bench gpu` hands over) X.json and the folder X beside it."""
    out = Path(args.out or Path.cwd() / ("bench_out/gpu_rehearsal" if args.smoke else "bench_out/gpu"))
    if out.suffix == ".json":
        return out, out.with_suffix("")
    return out / "report.json", out


def tokenizer_dir(args) -> str | None:
    for cand in (args.tokenizer, CARRY / "tokenizer"):
        if cand and Path(cand).is_dir():
            return str(cand)
    from rlspec.rollout.runtime.model.fetch import EMBEDDED_ALIAS, cache_root

    embedded = cache_root() / "models" / EMBEDDED_ALIAS
    return str(embedded) if (embedded / "tokenizer_config.json").is_file() else args.tokenizer


def site_dir(args) -> str | None:
    cand = args.site or (CARRY / "site" if (CARRY / "site").is_dir() else None)
    return str(cand) if cand else None


def write_json(path: Path, payload: dict) -> None:
    """Write whole or not at all: a reader (the parent, a cut-off copy) never sees half a file."""
    text = json.dumps(payload, indent=2, default=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_child(args) -> dict:
    """This process is the child of one section (or, in the rehearsal, of several in a row: "a,b"): run each,
    saving partial results to <folder>/<section>.json and, when it completes, its seconds."""
    from rlspec.bench.gpucheck import compiles
    from rlspec.bench.gpucheck.common import device_and_dtype

    _, folder = paths(args)
    device, dtype = device_and_dtype(args.smoke)
    compiles.install(log=args.ahead)
    result = {}
    for name in args.section.split(","):
        cfg = presets.config(name, args.smoke, tokenizer=tokenizer_dir(args), ahead=args.ahead)
        budget = presets.timeouts(args.smoke, args.timeout_s)[name] * 0.8  # stop starting measurements before the kill
        t0, start = time.perf_counter(), compiles.mark()

        def save(partial: dict, name=name, start=start, **extra) -> None:  # each save says what compiled so far
            write_json(folder / f"{name}.json", {**partial, "triton_compiles": compiles.since(start), **extra})

        result = presets.module(name).run(cfg, device, dtype, lambda: budget - (time.perf_counter() - t0), save)
        save(result, complete_s=round(time.perf_counter() - t0, 2))
    return result


def child(names: list[str], args, folder: Path, log, timeouts: list[str], ahead: bool = False) -> subprocess.Popen:
    """Start the child that runs sections `names` (their results saved to `folder`, its output to `log`) in a
    process group of its own (what a timeout kills); ahead: their compile-ahead form (gpucheck/ahead.py)."""
    cmd = [sys.executable, "-m", "rlspec.bench.gpu", "--section", ",".join(names), "--out", str(folder.resolve())]
    cmd += (["--smoke"] if args.smoke else []) + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    cmd += ["--timeout-s", *(args.timeout_s or []), *timeouts] if args.timeout_s or timeouts else []
    cmd += ["--ahead"] if ahead else []
    # the rehearsal checks the GPU path's plumbing: the CPU's own C++ kernels (built once per machine, minutes)
    # are no part of it, and tiny shapes run fastest on one thread (several fight over a shared CI machine)
    smoke_env = {"RLSPEC_CPU_KERNELS": os.environ.get("RLSPEC_CPU_KERNELS", "0"),
                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if args.smoke else {}
    env = harness.child_env({**smoke_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                            path=[site_dir(args)] if site_dir(args) else [])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def child_sections(names: list[str], args, folder: Path, timeout: float) -> dict[str, dict]:
    """Run sections `names` in one child with a timeout (one section on a GPU; the rehearsal runs its measuring
    sections in one child, paying the imports once); each one's saved result plus status, seconds and log. A lone
    section's own limit is the timeout (what it stops starting measurements by: its limit and what earlier
    sections left)."""
    log_name = f"{names[0]}.log"
    given = [f"{names[0]}={timeout:.1f}"] if len(names) == 1 else []
    for name in names:
        (folder / f"{name}.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(folder / log_name, "w") as log:
        proc = child(names, args, folder, log, given)
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = f"timeout ({timeout:.0f} s)"
    out = {}
    for name in names:
        saved = folder / f"{name}.json"
        result = json.loads(saved.read_text()) if saved.is_file() else {}
        seconds = result.pop("complete_s", None)
        # a section the child completed is ok even if a later one in the same child failed
        state = "ok" if seconds is not None else (status if status != "ok" else "failed (not completed)")
        if isinstance(result.get("skipped"), str) and state == "ok":  # the whole section could not run here
            state = "skipped"
        out[name] = {**result, "status": state, "log": log_name,
                     "seconds": seconds if seconds is not None else round(time.perf_counter() - t0, 2)}
    return out


def header(args) -> dict:
    import torch
    import transformers

    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                **harness.source_state(), smoke=args.smoke,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, transformers=transformers.__version__, triton=_version("triton"),
                python=sys.version.split()[0],
                # what the carried trl/datasets (e2e) import from the machine's own packages
                packages={p: _version(p) for p in ("pyarrow", "huggingface_hub", "accelerate", "fsspec")})


def _version(package: str) -> str | None:
    """An installed package's version (our kernels' compiler, whose version the GPU machine's torch picks), or None."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run(args) -> dict:
    """Every asked section in order, the report rewritten after each; returns the report."""
    if args.section:
        return run_child(args)
    report_path, folder = paths(args)
    folder.mkdir(parents=True, exist_ok=True)
    limits = presets.timeouts(args.smoke, args.timeout_s)
    report = {**header(args), "sections_run": args.sections, "timeouts_s": limits, "given_s": {}}
    t0, planned = time.perf_counter(), 0.0
    beside_tests = args.sections[0] in presets.TEST_SECTIONS and not args.no_ahead
    compiling = ahead.start(args, folder, child) if beside_tests else None
    try:
        for group in groups(args.sections, args.smoke):
            # a group may take what the ones before it left of their limits: the check still ends within the sum
            # of its limits, and the core within the core's (given_s: the seconds each group had)
            planned += sum(limits[n] for n in group)
            given = planned - (time.perf_counter() - t0)
            report["given_s"]["+".join(group)] = round(given, 1)
            print(f"[gpu] {'+'.join(group)} (limit {given:.0f} s) ...", flush=True)
            if group[0] in presets.TEST_SECTIONS:
                report[group[0]] = test_section(group[0], args, given, folder)
                if compiling is not None:  # what the sections after will launch was compiled beside the tests
                    report["ahead"], compiling = compiling.stop(), None
            else:
                report.update(child_sections(group, args, folder, given))
            report["elapsed_s"] = round(time.perf_counter() - t0, 2)
            predict.annotate(report)  # the formula's speedup beside each oracle row, from this run's verify costs
            write_json(report_path, report)
            print(f"[gpu] {', '.join(n + ': ' + report[n]['status'] for n in group)} "
                  f"({report['elapsed_s']:.0f} s so far)", flush=True)
    finally:  # a check cut short by an error leaves no compile-ahead child behind
        if compiling is not None:
            compiling.stop()
    report["ok"] = not failed(report)  # the harness's exit status reads it
    report["aims"] = aims.evaluate(report)  # what the check steers by, judged on this run (an H200's)
    write_json(report_path, report)
    presets.print_summary(report)
    print("\n".join(aims.lines(report["aims"])), flush=True)
    print(f"wrote {report_path}", flush=True)
    args.out = str(report_path)  # the harness writes its copy of the report to args.out: the same file
    return report


def groups(sections: list[str], smoke: bool) -> list[list[str]]:
    """The children to start: one per section on a GPU (a hung CUDA call takes only its own section down); in
    the rehearsal one per run of consecutive measuring sections (the tests always apart)."""
    out: list[list[str]] = []
    for name in sections:
        joins = smoke and out and name not in presets.TEST_SECTIONS and out[-1][0] not in presets.TEST_SECTIONS
        out[-1:] = [out[-1] + [name]] if joins else [*out[-1:], [name]]
    return out


def test_section(name: str, args, limit: float, folder: Path) -> dict:
    """The CUDA tests of `name` (the core subset, or the rest), or why they cannot run here (no tests/ beside the
    package: an installed wheel)."""
    from rlspec.bench.gpucheck import cuda_tests

    if not (ROOT / "tests" / "gpu").is_dir():
        return {"skipped": f"no tests/gpu beside rlspec ({ROOT}): run the check from a checkout for the CUDA tests",
                "status": "skipped", "tests": []}
    t0 = time.perf_counter()
    per_test = args.per_test_timeout_s or presets.per_test_timeout(args.smoke)
    if name == "tests":
        targets, exclude, last = presets.CORE_TESTS, [], []
    else:
        targets, exclude, last = presets.TEST_TARGETS, presets.CORE_TESTS, presets.LAST_TESTS
    targets = [t for t in targets if (ROOT / t.split("::")[0]).exists()]
    sec = cuda_tests.run(targets, "gpu", per_test, limit, folder, ROOT, exclude=exclude, name=name, last=last)
    return {**sec, "status": "ok" if sec["ok"] else "failed", "seconds": round(time.perf_counter() - t0, 2),
            "log": f"{name}.log"}


def failed(report: dict) -> list[str]:
    """Sections that did not complete (a skipped one did what it could: it says why)."""
    return [s for s in SECTIONS + presets.EXTRAS if s in report and report[s]["status"] not in ("ok", "skipped")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = run(args)
    if args.section:
        return 0
    bad = failed(report)
    if bad:
        print(f"[gpu] not completed: {', '.join(bad)} (see their logs in {paths(args)[1]})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
