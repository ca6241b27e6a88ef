"""Chaos: every fault rlspec handles, injected into short real runs of the embedded model.

Each fault runs `python -m rlspec.train config=grpo_math.yaml` on SmolLM2-135M (float32, suffix speculation
with `drafter.selector=always`, 4 steps, a checkpoint every 2), injects the fault, does what README.md's
"When a run crashes" tells a user to type (mostly `resume=auto`), and compares the result with an
uninterrupted run of the same config and seed: the rewards logged after the resume point and the final
weights (largest absolute difference). Signals and `kill -9` come from outside the process, as a scheduler
or a user sends them; the only hooks inside the run (`python -m rlspec.bench.chaos --child`) mark when a step begins
(so a fault lands in a known step) and poison one weight for the NaN faults.

    python -m rlspec.bench chaos                      # every fault, ~30 min on 2 CPU cores
    python -m rlspec.bench chaos --only kill9_mid_step,nan_stop
    python -m rlspec.bench chaos --only nan_at_save_step --straight outputs/chaos/straight   # reuse a straight run

The report: per fault, when it was injected, what the user saw (exit code, the message), what was lost, and
whether the continued run equals the straight one. The faults: rlspec/bench/chaos_faults.py.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from rlspec.bench import chaos_run
from rlspec.bench.chaos_faults import FAULTS
from rlspec.bench.chaos_run import BASE, Run, child, history, max_weight_diff
from rlspec.bench.common import EMBEDDED, smoke_model

NAME = "chaos"
HELP = "every fault rlspec handles (kill -9, signals, NaN, bad input), injected into real runs, then resumed"
NO_STRAIGHT = ("long_prompt", "unsupported_model", "nan_skip_batch", "bad_rows")  # faults that compare with no straight run


def add_arguments(p) -> None:
    p.add_argument("--only", default="", help=f"comma-separated faults (default: all of {','.join(FAULTS)})")
    p.add_argument("--workdir", default="outputs/chaos")
    p.add_argument("--straight", default="", help="the directory of a finished straight run of this config to "
                   "compare with (copied into the workdir) instead of running one")


def run(args) -> dict:
    if args.smoke:  # one run of a tiny model, refused before step 1: no straight run
        args.only, args.workdir = "bad_rows", str(Path(args.out).with_suffix("")) + "_runs"
    chaos_run.OVERRIDES[:] = ([f"model={smoke_model(EMBEDDED, args.workdir)}", "grpo.max_completion_length=8"]
                              if args.smoke else [])
    names = [n for n in args.only.split(",") if n] or list(FAULTS)
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; choose from {sorted(FAULTS)}")
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()
    straight, moved = work / "straight", None
    if any(n not in NO_STRAIGHT for n in names):
        if args.straight:
            shutil.copytree(Path(args.straight).resolve(), straight)
        elif Run(straight).wait() != 0:
            raise SystemExit(f"the straight run failed; see {straight}.log")
        moved = max_weight_diff(straight / "final", straight / "checkpoint-2")
    rows = [one_fault(name, work, straight) for name in names]
    return {"config": BASE, "straight_rewards": history(straight), "policy_moved_steps_3_4_max_abs": moved,
            "faults": rows, "rows": rows, "wall_s": round(time.time() - t0, 1),
            "columns": ["name", "injected", "exit_code", "lost", "handled", "resumed_equals_straight"],
            "ok": all(r.get("resumed_equals_straight") is not False and r.get("handled") is not False for r in rows)}


def one_fault(name: str, work: Path, straight: Path) -> dict:
    start = time.time()
    try:
        row = FAULTS[name](work, straight)
    except Exception as exc:  # noqa: BLE001 - one fault's harness failure must not hide the others
        row = {"fault": name, "harness_error": f"{type(exc).__name__}: {exc}", "resumed_equals_straight": False}
    row.update(name=name, wall_s=round(time.time() - start, 1))
    print(f"[chaos] {name}: exit {row.get('exit_code')}, resumed = straight: {row.get('resumed_equals_straight')}",
          flush=True)
    return row


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    sys.exit(child(sys.argv[2:]))
