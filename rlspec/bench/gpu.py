"""The device check (`make gpu-check`) and its CPU rehearsal (`make gpu-rehearsal`, --smoke): one prepared run
for one GPU with the software a GPU machine has (its own python3 with a CUDA torch; no registry, no hub, no
vLLM), writing one JSON report and a log per section to --out as each section completes, so a run cut off still
returns what it did.

Sections, in order (the core, tests and plain, ~6 minutes on an H200; the whole check ~9):
  tests       each CUDA test in a pytest child with a timeout of its own: outcome, seconds (gpucheck/cuda_tests.py)
  plain       engine vs transformers, SmolLM2-135M and Qwen2.5-7B shapes, batch 1/8/32/128: graph step ms, tok/s
  spec_costs  7B shape: verify of T = 2..8 tokens (chains, trees) relative to a plain step per batch bucket;
              EAGLE-3 drafting ms per token
  oracle      7B shape, T = 0: rollouts with a drafter of known per-token acceptance a (0.5/0.7/0.9), batch
              1/8/32, vs plain decoding: the check of docs/gpu.md's predicted speedup
  grpo        3 GRPO steps through SpecGRPOTrainer, SmolLM2 shape over a carried tokenizer: seconds per phase
              (skipped, and why, where TRL is not importable)
Every section but tests runs in a child process with a timeout (a hung CUDA call cannot take the report down).

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

from rlspec.bench.gpucheck import predict, presets

NAME = "gpu"
HELP = "the device check: CUDA tests, plain decode, speculation costs, oracle rollouts, GRPO steps (--smoke: CPU)"
ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("tests", "plain", "spec_costs", "oracle", "grpo")
CARRY = ROOT / ".cache" / "gpu_carry"  # what a GPU machine gets carried: tokenizer/, site/ (docs/gpu.md)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="the rehearsal: tiny shapes on the CPU, the same sections and report, in ~2 minutes")
    parser.add_argument("--out", default=None,
                        help="report folder (default bench_out/gpu; with --smoke bench_out/gpu_rehearsal); a path "
                             "X.json names the report itself, the logs going to the folder X")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="sections to run")
    parser.add_argument("--tokenizer", default=None,
                        help=f"tokenizer directory for the grpo section (default {CARRY.relative_to(ROOT)}/tokenizer, "
                             "else the embedded model's in the rlspec cache)")
    parser.add_argument("--site", default=None,
                        help=f"extra import path for the sections (carried trl/datasets; default "
                             f"{CARRY.relative_to(ROOT)}/site where it exists)")
    parser.add_argument("--per-test-timeout-s", type=float, default=None, help="one CUDA test's limit")
    parser.add_argument("--timeout-s", nargs="*", default=None, metavar="SECTION=S",
                        help="override section limits, e.g. tests=120 oracle=200 (seconds)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: run this section here


def paths(args) -> tuple[Path, Path]:
    """(report file, folder for logs and section files): DIR/report.json and DIR, or for a report path X.json
    (what `python -m rlspec.bench gpu` hands over) X.json and the folder X beside it."""
    out = Path(args.out or ROOT / ("bench_out/gpu_rehearsal" if args.smoke else "bench_out/gpu"))
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
    """This process is one section's child: run it, saving partial results to <folder>/<section>.json."""
    from rlspec.bench.gpucheck.common import device_and_dtype

    name = args.section
    _, folder = paths(args)
    device, dtype = device_and_dtype(args.smoke)
    cfg = presets.config(name, args.smoke, tokenizer=tokenizer_dir(args))
    budget = presets.timeouts(args.smoke, args.timeout_s)[name] * 0.8  # stop starting measurements before the kill
    t0 = time.perf_counter()
    module = presets.module(name)
    result = module.run(cfg, device, dtype, lambda: budget - (time.perf_counter() - t0),
                        lambda partial: write_json(folder / f"{name}.json", partial))
    write_json(folder / f"{name}.json", result)
    return result


def child_section(name: str, args, folder: Path, timeout: float) -> dict:
    """Run section `name` in a child with a timeout; its saved result plus status, seconds and log."""
    cmd = [sys.executable, "-m", "rlspec.bench.gpu", "--section", name, "--out", str(folder)]
    cmd += (["--smoke"] if args.smoke else []) + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    cmd += ["--timeout-s", *args.timeout_s] if args.timeout_s else []
    # the rehearsal checks the GPU path's plumbing: the CPU's own C++ kernels (built once per machine, minutes)
    # are no part of it, and tiny shapes run fastest on one thread (several fight over a shared CI machine)
    smoke_env = {"RLSPEC_CPU_KERNELS": os.environ.get("RLSPEC_CPU_KERNELS", "0"),
                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if args.smoke else {}
    env = {**os.environ, **smoke_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), site_dir(args), os.environ.get("PYTHONPATH")]))}
    (folder / f"{name}.json").unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(folder / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = f"timeout ({timeout:.0f} s)"
    saved = folder / f"{name}.json"
    result = json.loads(saved.read_text()) if saved.is_file() else {}
    if isinstance(result.get("skipped"), str) and status == "ok":  # the whole section could not run here
        status = "skipped"
    return {**result, "status": status, "seconds": round(time.perf_counter() - t0, 2), "log": f"{name}.log"}


def header(args) -> dict:
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                commit=commit.stdout.strip() or None, smoke=args.smoke,
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, transformers=transformers.__version__, python=sys.version.split()[0])


def run(args) -> dict:
    """Every asked section in order, the report rewritten after each; returns the report."""
    if args.section:
        return run_child(args)
    report_path, folder = paths(args)
    folder.mkdir(parents=True, exist_ok=True)
    limits = presets.timeouts(args.smoke, args.timeout_s)
    report = {**header(args), "sections_run": args.sections, "timeouts_s": limits}
    t0 = time.perf_counter()
    for name in args.sections:
        print(f"[gpu] {name} (limit {limits[name]:.0f} s) ...", flush=True)
        if name == "tests":
            from rlspec.bench.gpucheck import cuda_tests

            targets, marker = presets.TEST_TARGETS, "gpu"
            per_test = args.per_test_timeout_s or presets.per_test_timeout(args.smoke)
            report[name] = cuda_tests.run(targets, marker, per_test, limits[name], folder, ROOT)
            report[name]["status"] = "ok" if report[name]["ok"] else "failed"
        else:
            report[name] = child_section(name, args, folder, limits[name])
        report["elapsed_s"] = round(time.perf_counter() - t0, 2)
        predict.annotate(report)  # the formula's speedup beside each oracle row, from this run's verify costs
        write_json(report_path, report)
        print(f"[gpu] {name}: {report[name]['status']} ({report['elapsed_s']:.0f} s so far)", flush=True)
    report["ok"] = not failed(report)  # the harness's exit status reads it
    presets.print_summary(report)
    print(f"wrote {report_path}", flush=True)
    args.out = str(report_path)  # the harness writes its copy of the report to args.out: the same file
    return report


def failed(report: dict) -> list[str]:
    """Sections that did not complete (a skipped one did what it could: it says why)."""
    return [s for s in SECTIONS if s in report and report[s]["status"] not in ("ok", "skipped")]


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
