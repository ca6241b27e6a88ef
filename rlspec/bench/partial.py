"""Partial rollouts (docs/partial_rollouts.md) on a long-tail GRPO run: on against off, with and without speculation.

SpecGRPOTrainer on the embedded model and math task at temperature 1.0 with a long completion cap (1024 tokens),
where a few samples run far longer than the rest, so a step that waits for its slowest sample idles most of its
rows. Each arm trains in a fresh process (as `dropin`: the user's own model loading, GRPOConfig(bf16=True) over
float32 master weights), arms alternate over repetitions in rotating order with the same seeds:

  off/plain   partial_rollouts=None                           spec_config=None
  on/plain    partial_rollouts=dict(oversample, max_staleness)  spec_config=None
  off/spec    partial_rollouts=None                           spec_config=SpecConfig(drafter=--drafter)
  on/spec     both

Per arm: wall seconds of train() to max_steps; rollout seconds per step (the trainer's rollout/wall_s less its
weight sync: a partial round runs before TRL's _generate, so timing that method would miss it); the mean trained
completion length (TRL's completions/mean_length over the steps: partial rollouts also train the long samples,
rounds later); partial/dropped_stale_frac (last step), partial/carried_samples, partial/on_policy_token_frac and
partial/staleness_mean (means over steps); the mean reward; and greedy accuracy on held-out problems after
training (rlspec.eval's held-out set and scorer). Ratios, medians of per-repetition ratios: off/on wall time for
each speculation setting (above 1: partial rollouts reach max_steps sooner) and trained length on/off.

    python -m rlspec.bench partial --reps 1
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, tiny_model
from rlspec.bench.dropin import PhaseClock

NAME = "partial"
HELP = "GRPO on a long-tail task: partial rollouts on vs off, with and without speculation (wall, staleness, accuracy)"
ARMS = ("off/plain", "on/plain", "off/spec", "on/spec")
RUNS = harness.ChildRuns(NAME)  # each run in a fresh process (--child)
EVAL_PROMPTS = 32  # held-out problems scored after training (--eval-prompts; none under --smoke unless asked)
# what one run needs from the command line (the child's settings)
SPEC_KEYS = ("model", "weights", "dataset", "examples", "temperature", "max_completion", "generations", "batch",
             "steps", "lr", "oversample", "max_staleness", "drafter", "eval_prompts", "eval_max_tokens", "eval_seed",
             "device", "seed", "smoke")


def add_arguments(p) -> None:
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--drafter", default="suffix", help="SpecConfig(drafter=...) of the spec arms (suffix, auto, ...)")
    p.add_argument("--model", default=EMBEDDED, help="model alias or local HF directory")
    p.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                   help="master weights' dtype; the step runs under bf16 mixed precision either way (as dropin)")
    p.add_argument("--dataset", default="embedded_math", help="rlspec.trainers.data.load_dataset_by_name name")
    p.add_argument("--examples", type=int, default=256, help="training prompts (TRL's sampler hands them out; partial rounds start its later ones early)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-completion", type=int, default=1024, help="max_completion_length")
    # the shape of configs/grpo_math.yaml, the default run: 2 prompts x 4 samples a step
    p.add_argument("--generations", type=int, default=4, help="num_generations")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (prompts per step x generations)")
    p.add_argument("--steps", type=int, default=5, help="max_steps")
    p.add_argument("--lr", type=float, default=1e-6, help="learning_rate")
    p.add_argument("--oversample", type=float, default=1.0, help="partial rollouts: extra groups in flight")
    p.add_argument("--max-staleness", type=int, default=4, help="partial rollouts: most optimizer steps a token ages")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help=f"held-out problems (rlspec.eval.heldout_math, the embedded task whatever --dataset) scored "
                        f"greedily after training; default {EVAL_PROMPTS}, 0 under --smoke; 0 skips")
    p.add_argument("--eval-max-tokens", type=int, default=256)
    p.add_argument("--eval-seed", type=int, default=1234, help="seed of the held-out problems")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the trainer runs")
    p.add_argument("--reps", type=int, default=1, help="repetitions of each arm (alternated; medians)")
    RUNS.add_flag(p)


def run(args) -> dict:
    served = RUNS.serve(args, child)
    if served is not None:
        return served
    if args.smoke:  # in this process (imports paid once), a tiny random-weight model (tiny_model), eager float32
        args.steps, args.reps, args.batch, args.generations, args.max_completion = 2, 1, 4, 2, 8
        args.examples, args.eval_max_tokens = 16, 8
    if args.eval_prompts is None:
        args.eval_prompts = 0 if args.smoke else EVAL_PROMPTS
    if args.no_eval:
        args.eval_prompts = 0
    if any(arm.endswith("/spec") for arm in args.arms):  # a bad --drafter fails now, not in the first spec arm
        from rlspec.rollout.types import SpecConfig

        SpecConfig(drafter=args.drafter)
    arms = {arm: (lambda rep, arm=arm: run_arm(args, arm, rep)) for arm in args.arms}
    return summarize(harness.alternate(arms, args.reps, say=_say), args)


def _say(arm, rep, result):
    print(f"[bench partial] {arm} rep {rep}: {result['wall_s']:.1f} s, rollout {sum(result['rollout_s']):.1f} s, "
          f"trained length {result['trained_len'] or 0:.0f}", flush=True)


def run_arm(args, arm: str, rep: int) -> dict:
    """One training run: a fresh process (in this one for --smoke); its result dict."""
    spec = dict(arm=arm, rep=rep, **{key: getattr(args, key) for key in SPEC_KEYS})
    return child(spec) if args.smoke else RUNS.spawn(spec, f"partial run {arm}")


# ---- the report ------------------------------------------------------------------------------------------------
METRICS = ("trained_len", "clipped_frac", "carried_samples", "on_policy_token_frac", "staleness_mean",
           "dropped_stale_frac", "reward", "heldout_accuracy", "decode_steps", "rows_per_step")


def summarize(runs: dict[str, list[dict]], args) -> dict:
    rows = []
    for arm, rs in runs.items():
        row = {"arm": arm, "wall_s": statistics.median(r["wall_s"] for r in rs),
               # per step of the run: a partial round may need no generation (its groups were complete)
               "rollout_s_per_step": statistics.median(sum(r["rollout_s"]) / args.steps for r in rs)}
        row.update({key: _median(rs, key) for key in METRICS})
        if arm.startswith("on/") and f"off/{arm[3:]}" in runs:  # against the same speculation with partial off
            off = runs[f"off/{arm[3:]}"]
            row["wall_off_over_on"] = statistics.median(o["wall_s"] / r["wall_s"] for o, r in zip(off, rs))
            row["len_on_over_off"] = _ratio_median(rs, off, "trained_len")
            row["steps_off_over_on"] = _ratio_median(off, rs, "decode_steps")
        rows.append(row)
    ratios = {f"{key}/{row['arm'][3:]}": row[key] for row in rows
              for key in ("wall_off_over_on", "len_on_over_off", "steps_off_over_on") if key in row}
    cols = ["arm", "wall_s", "rollout_s_per_step", "decode_steps", "rows_per_step", "trained_len", "carried_samples",
            "on_policy_token_frac", "dropped_stale_frac", "heldout_accuracy", "wall_off_over_on", "len_on_over_off",
            "steps_off_over_on"]
    return {"rows": rows, "columns": cols, "ratios": ratios, "runs": runs, "smoke": args.smoke}


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(results: list[dict], key: str):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ratio_median(num: list[dict], den: list[dict], key: str):
    values = [a[key] / b[key] for a, b in zip(num, den) if a.get(key) is not None and b.get(key)]
    return statistics.median(values) if values else None


def plot(report: dict, path: str) -> None:
    rows = report["rows"]
    labels = [r["arm"] for r in rows]
    with harness.png(path, 1, 2, figsize=(10, 3.6)) as (fig, (ax, bx)):
        ax.bar(labels, [r["wall_s"] for r in rows], label="end to end")
        ax.bar(labels, [r["rollout_s_per_step"] * report["args"]["steps"] for r in rows], label="of which rollout")
        ax.set_ylabel("seconds to max_steps")
        ax.set_title("GRPO, partial rollouts off/on (medians)")
        ax.legend(fontsize=7)
        bx.bar(labels, [r["trained_len"] or 0 for r in rows])
        bx.set_ylabel("mean trained completion length (tokens)")
        bx.set_title(f"{report.get('date')} {report.get('commit')}")


# ---- one run (the child process) ------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.types import SpecConfig
    from rlspec.trainers.data import load_dataset_by_name
    from rlspec.trainers.grpo import SpecGRPOTrainer
    from rlspec.trainers.rewards import get_reward_funcs

    path = fetch_model(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = torch.bfloat16 if spec["weights"] == "bf16" else torch.float32
    model = tiny_model(path) if spec["smoke"] else AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    partial, speculate = spec["arm"].split("/")
    with tempfile.TemporaryDirectory() as out:
        # --smoke: float32 keeps the CPU step eager (bf16 compiles the engine's step first, which takes minutes)
        args = trl.GRPOConfig(output_dir=out, bf16=not spec["smoke"], use_cpu=spec["device"] == "cpu",
                              per_device_train_batch_size=spec["batch"], num_generations=spec["generations"],
                              max_completion_length=spec["max_completion"], temperature=spec["temperature"],
                              learning_rate=spec["lr"], max_steps=spec["steps"], seed=spec["seed"], logging_steps=1,
                              report_to="none", save_strategy="no", disable_tqdm=True)
        trainer = SpecGRPOTrainer(
            model=model, reward_funcs=get_reward_funcs(["accuracy"]), args=args, processing_class=tokenizer,
            train_dataset=load_dataset_by_name(spec["dataset"], num_examples=spec["examples"], seed=spec["seed"]),
            spec_config=SpecConfig(drafter=spec["drafter"]) if speculate == "spec" else None,
            partial_rollouts=dict(oversample=spec["oversample"], max_staleness=spec["max_staleness"])
            if partial == "on" else None)
        phases = PhaseClock(trainer)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        accuracy = heldout_accuracy(trainer, tokenizer, spec) if spec["eval_prompts"] > 0 else None
    # the training phases; rollout and sync come from the trainer's own timings (run_metrics), which see a round
    phases = {p: v for p, v in phases.per_step(spec["steps"]).items() if p not in ("rollout", "sync")}
    result = dict(arm=spec["arm"], wall_s=wall, phases=phases, heldout_accuracy=accuracy,
                  **run_metrics(trainer.state.log_history))
    return result


def run_metrics(history: list[dict]) -> dict:
    """What the trainer logged, step by step (logging_steps=1), reduced to one figure each."""
    steps = [h for h in history if "completions/mean_length" in h]

    def values(key):
        return [h[key] for h in steps if key in h]

    dropped = values("partial/dropped_stale_frac")
    return dict(rollout_s=[w - s for w, s in zip(values("rollout/wall_s"), values("rollout/sync_s"))],
                trained_len=_mean(values("completions/mean_length")),
                clipped_frac=_mean(values("completions/clipped_ratio")), reward=_mean(values("reward")),
                dropped_stale_frac=dropped[-1] if dropped else None,
                carried_samples=_mean(values("partial/carried_samples")),
                on_policy_token_frac=_mean(values("partial/on_policy_token_frac")),
                staleness_mean=_mean(values("partial/staleness_mean")),
                accept_len=_mean(values("rollout/accept_len")),
                # the sequential decode steps the rollouts took, and the rows a step decoded on average: what a GPU,
                # whose step costs about the same from 1 to 32 rows, pays is the steps
                decode_steps=sum(values("rollout/decode_steps")),
                rows_per_step=sum(values("rollout/generated_tokens")) / max(sum(values("rollout/decode_steps")), 1))


def heldout_accuracy(trainer, tokenizer, spec: dict) -> float:
    """Greedy accuracy of the trained policy on held-out problems (rlspec.eval's set and scorer), sampled by a
    plain engine built from the policy's weights in the dtype the run sampled in (no drafter: a greedy score)."""
    from rlspec.eval import evaluate, heldout_math
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams
    from rlspec.trainers.data import prompt_token_ids
    from rlspec.trainers.rollout_source import sampling_dtypes
    from rlspec.trainers.weight_sync import unwrap_model

    policy = unwrap_model(trainer.model, trainer.accelerator)
    convs, answers = heldout_math(spec["eval_prompts"], seed=spec["eval_seed"])
    engine = RolloutEngine.from_hf_model(policy, tokenizer, max_model_len=spec["eval_max_tokens"] + 256,
                                         max_num_seqs=spec["eval_prompts"],
                                         **sampling_dtypes(trainer.args, policy, {}))
    params = SamplingParams(temperature=0.0, max_new_tokens=spec["eval_max_tokens"], n=1, seed=spec["seed"])
    try:
        return evaluate(engine, prompt_token_ids(tokenizer, convs), answers, params)["accuracy"]
    finally:
        engine.close()


if __name__ == "__main__":
    from rlspec.bench.__main__ import main

    main([NAME, *sys.argv[1:]])
