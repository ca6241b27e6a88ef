"""The drop-in, as a TRL user meets it: trl.GRPOTrainer against SpecGRPOTrainer with only the class changed.

Each run is a fresh process (`--child`): the user's own code, `AutoModelForCausalLM.from_pretrained(path, dtype=...)`,
`GRPOConfig(bf16=True, per_device_train_batch_size=8, num_generations=4, max_completion_length=128, use_cpu=True)`,
the embedded math task and its accuracy reward, N optimizer steps. Arms:

  trl         trl.GRPOTrainer (its own transformers generation)
  spec        SpecGRPOTrainer, no spec_config (plain decoding in the engine)
  spec-auto   SpecGRPOTrainer(spec_config=SpecConfig(drafter="auto"))

for two models: `fp32` (float32 master weights under bf16 mixed precision, the common case) and `bf16` (loaded in
bf16). Arms alternate in rotating order, same seeds; the figures are medians over repetitions and per-repetition
ratios against trl. Per step, the phases: rollout (generation, weight sync apart), sync, the old-logprob pass,
rewards, the loss's forward, backward, optimizer; and, for SpecGRPOTrainer, what TRL's importance-sampling
correction masked (sequences and tokens) and what speculation saved or cost.

    python -m rlspec.bench dropin --reps 3 --steps 6
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

from rlspec.bench import harness

NAME = "dropin"
HELP = "trl.GRPOTrainer vs SpecGRPOTrainer (plain, auto) as a TRL user swaps the class: end to end, per phase"
ARMS = ("trl", "spec", "spec-auto")
MODELS = ("fp32", "bf16")
PHASES = ("rollout", "sync", "old_logprobs", "rewards", "loss_forward", "backward", "optimizer")
RUNS = harness.ChildRuns(NAME)  # each run in a fresh process (--child)


def add_arguments(p) -> None:
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--generations", type=int, default=4, help="num_generations")
    p.add_argument("--max-completion", type=int, default=128, help="max_completion_length")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model alias or local HF directory")
    p.add_argument("--is-prompts", type=int, default=16, help="prompts (x --generations samples) of the "
                   "importance-sampling probe: what TRL's default sequence_mask would drop under bf16 sampling; 0 skips")
    RUNS.add_flag(p)


def run(args) -> dict:
    served = RUNS.serve(args, child)
    if served is not None:
        return served
    if args.smoke:
        args.steps, args.reps, args.batch, args.generations, args.max_completion = 1, 1, 2, 2, 4
    probe = is_probe(args) if args.is_prompts > 0 else None
    runs: dict[str, list[dict]] = defaultdict(list)
    for model in args.models:
        arms = {arm: (lambda rep, arm=arm, model=model: spawn(args, arm, model, rep)) for arm in args.arms}
        for arm, results in harness.alternate(arms, args.reps, say=_say(model)).items():
            runs[f"{model}/{arm}"] = results
    return {**summarize(runs, args), "is_probe": probe}


def _say(model):
    def say(arm, rep, result):
        print(f"[bench dropin] {model}/{arm} rep {rep}: {result['total_s']:.1f} s "
              f"(rollout {sum(result['phases']['rollout']):.1f} s)", flush=True)
    return say


def spawn(args, arm: str, model: str, rep: int) -> dict:
    """One training run in a fresh process; its result dict."""
    spec = dict(arm=arm, model=model, rep=rep, steps=args.steps, batch=args.batch, generations=args.generations,
                max_completion=args.max_completion, model_path=args.model, seed=args.seed, smoke=args.smoke)
    return RUNS.spawn(spec, f"dropin run {arm}/{model}")


def summarize(runs: dict[str, list[dict]], args) -> dict:
    totals = {name: [r["total_s"] for r in rs] for name, rs in runs.items()}
    rows = []
    for name, rs in runs.items():
        model, arm = name.split("/")
        base = totals.get(f"{model}/trl")
        speed = statistics.median(b / t for b, t in zip(base, totals[name])) if base else None
        phases = {p: statistics.median(sum(r["phases"][p]) / max(len(r["phases"][p]), 1) for r in rs)
                  for p in PHASES}
        rows.append({"model": model, "arm": arm, "total_s": statistics.median(totals[name]),
                     "speedup_vs_trl": speed,
                     **{f"{p}_s_per_step": v for p, v in phases.items()},
                     "is_masked_seq_frac": _median(rs, "is_masked_seq_frac"),
                     "is_masked_token_frac": _median(rs, "is_masked_token_frac"),
                     "spec_saved_s": _median(rs, "spec_saved_s"),
                     "reward": _median(rs, "reward")})
    cols = ["model", "arm", "total_s", "speedup_vs_trl", "rollout_s_per_step", "old_logprobs_s_per_step",
            "backward_s_per_step", "is_masked_seq_frac", "spec_saved_s"]
    return {"rows": rows, "columns": cols, "runs": runs, "smoke": args.smoke}


def _median(results: list[dict], key: str):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def plot(report: dict, path: str) -> None:
    rows = report["rows"]
    with harness.png(path, 1, 2, figsize=(11, 3.8)) as (fig, (ax, bx)):
        labels = [f"{r['model']}\n{r['arm']}" for r in rows]
        bottom = [0.0] * len(rows)
        for phase in PHASES:
            values = [r[f"{phase}_s_per_step"] for r in rows]
            ax.bar(labels, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("seconds per step")
        ax.set_title("a GRPO step, phase by phase (medians)")
        ax.legend(fontsize=7)
        bx.bar(labels, [r["speedup_vs_trl"] or 0 for r in rows])
        bx.axhline(1.0, color="k", lw=0.8)
        bx.set_ylabel("x trl.GRPOTrainer (end to end)")
        bx.set_title(f"{report.get('date')} {report.get('commit')}")


# ---- the importance-sampling probe -----------------------------------------------------------------------------
def is_probe(args) -> dict:
    """What TRL's importance-sampling modes would zero under bf16 sampling against float32 master weights: the
    engine samples in bf16 (its per-token logprobs), the float32 model recomputes them under bf16 autocast (TRL's
    old-logprob pass under bf16=True); sequence_mask drops a sample whose summed log-ratio passes log(cap)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.types import SamplingParams
    from rlspec.trainers.data import make_math_dataset

    path = fetch_model(args.model)
    engine = RolloutEngine.from_pretrained(path, dtype="bfloat16", max_model_len=512, max_num_seqs=16)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.smoke:
        args.is_prompts = 2
    tok, data = engine.tokenizer, make_math_dataset(max(args.is_prompts, 1), seed=args.seed)
    prompts = [tok.apply_chat_template(data[i]["prompt"], add_generation_prompt=True, return_dict=False)
               for i in range(args.is_prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_completion, n=args.generations, seed=args.seed,
                            stop_token_ids=[tok.eos_token_id])
    sums, diffs = [], []
    for r in engine.generate(prompts, params):
        ids = torch.tensor([list(r.prompt_ids) + list(r.completion_ids)])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = policy(ids).logits.float()[0, len(r.prompt_ids) - 1:-1]
        old = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        d = old - torch.tensor(r.logprobs)  # log pi - log mu per token
        diffs.append(d)
        sums.append(float(d.sum()))
    d, cap = torch.cat(diffs), math.log(3.0)
    out = {"samples": len(sums), "tokens": int(d.numel()), "cap": 3.0,
           "sequence_mask_dropped_frac": sum(x > cap for x in sums) / len(sums),
           "token_mask_dropped_token_frac": float((d > cap).float().mean()),
           "token_truncate_clipped_token_frac": float((d > cap).float().mean()),
           "token_abs_log_ratio_mean": float(d.abs().mean()), "token_abs_log_ratio_max": float(d.abs().max()),
           "sequence_log_ratio_sd": float(torch.tensor(sums).std()) if len(sums) > 1 else 0.0}
    print(f"[bench dropin] IS probe, {out['samples']} samples: TRL's default sequence_mask drops "
          f"{100 * out['sequence_mask_dropped_frac']:.1f}% of them; token_truncate clips "
          f"{100 * out['token_truncate_clipped_token_frac']:.2f}% of tokens", flush=True)
    return out


# ---- one run (the child process) ------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.trainers.data import make_math_dataset
    from rlspec.trainers.grpo import SpecGRPOTrainer
    from rlspec.trainers.rewards import get_reward_funcs
    from rlspec.rollout.types import SpecConfig

    path = fetch_model(spec["model_path"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = torch.float32 if spec["model"] == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if spec["smoke"]:
        model = _shrunk(model)
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(output_dir=out, bf16=True, use_cpu=True, per_device_train_batch_size=spec["batch"],
                              num_generations=spec["generations"], max_completion_length=spec["max_completion"],
                              max_steps=spec["steps"], seed=spec["seed"], logging_steps=1, report_to="none",
                              save_strategy="no", disable_tqdm=True)
        kwargs = dict(model=model, reward_funcs=get_reward_funcs(["accuracy"]), args=args,
                      train_dataset=make_math_dataset(max(64, spec["batch"] * spec["steps"]), seed=spec["seed"]),
                      processing_class=tokenizer)
        if spec["arm"] == "trl":
            trainer = trl.GRPOTrainer(**kwargs)
        else:
            config = SpecConfig(drafter="auto") if spec["arm"] == "spec-auto" else None
            trainer = SpecGRPOTrainer(**kwargs, spec_config=config)
        phases = PhaseClock(trainer)
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
    result = dict(arm=spec["arm"], model=spec["model"], total_s=total, phases=phases.per_step(spec["steps"]),
                  **_run_metrics(trainer.state.log_history))
    return result


def _shrunk(model):
    """--smoke: the model's architecture cut to 2 layers (random-free: the first layers' own weights)."""
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:2]
    return model


def _run_metrics(history: list[dict]) -> dict:
    steps = [h for h in history if "reward" in h]

    def mean(key):
        values = [h[key] for h in steps if key in h]
        return sum(values) / len(values) if values else None

    return dict(reward=mean("reward"), is_masked_seq_frac=mean("sampling/is_masked_sequence_frac"),
                is_masked_token_frac=mean("sampling/is_masked_token_frac"),
                spec_saved_s=_sum(steps, "rollout/spec_saved_s"),
                plain_step_ms=mean("rollout/plain_step_ms"), spec_step_share=mean("rollout/spec_step_share"))


def _sum(steps, key):
    values = [h[key] for h in steps if key in h]
    return sum(values) if values else None


class PhaseClock:
    """Seconds per phase of each step, by timing the trainer's own methods on this instance (both trainers run
    the same TRL code around generation, so the same wrappers time both)."""

    def __init__(self, trainer):
        import torch

        self.seconds: dict[str, list[float]] = defaultdict(list)
        self._torch = torch
        self._wrap(trainer, "_generate", "rollout")
        self._wrap(trainer, "_calculate_rewards", "rewards")
        self._wrap(trainer, "compute_loss", "loss_forward")
        self._wrap(trainer.accelerator, "backward", "backward")
        self._wrap_logps(trainer)
        syncer = getattr(trainer, "weight_syncer", None)
        if syncer is not None:
            self._wrap(syncer, "maybe_sync", "sync")
        from transformers import TrainerCallback

        clock = self

        class OptimizerClock(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                clock._opt = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                clock.seconds["optimizer"].append(time.perf_counter() - clock._opt)

        trainer.add_callback(OptimizerClock())

    @contextmanager
    def _timed(self, phase):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase].append(time.perf_counter() - start)

    def _wrap(self, obj, method: str, phase: str):
        inner = getattr(obj, method)

        def timed(*a, **kw):
            with self._timed(phase):
                return inner(*a, **kw)
        setattr(obj, method, timed)

    def _wrap_logps(self, trainer):
        inner = trainer._get_per_token_logps_and_entropies

        def timed(*a, **kw):
            if self._torch.is_grad_enabled():  # the loss's own forward: inside loss_forward
                return inner(*a, **kw)
            with self._timed("old_logprobs"):
                return inner(*a, **kw)
        trainer._get_per_token_logps_and_entropies = timed

    def per_step(self, steps: int) -> dict[str, list[float]]:
        """{phase: seconds per step}; rollout excludes the weight sync inside it."""
        out = {p: list(self.seconds.get(p, [])) for p in PHASES}
        if out["sync"] and len(out["sync"]) == len(out["rollout"]):
            out["rollout"] = [r - s for r, s in zip(out["rollout"], out["sync"])]
        return out


if __name__ == "__main__":
    from rlspec.bench.__main__ import main

    main([NAME, *sys.argv[1:]])
