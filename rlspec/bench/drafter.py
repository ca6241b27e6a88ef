"""The drafters: how fast the online EAGLE-3 drafter learns and what it buys in the long tail, and how fast the
model-free drafters propose.

  curve  rounds of: collect rollouts on training prompts (features go to the drafter's buffer), train the
         drafter --train-steps steps, measure the accepted length on held-out prompts (T=1, a chain of --k,
         speculation forced on); then tokens/s at live batch --eval-prompts: the engine without speculation,
         with the trained drafter forced, and with the selector's choice, alternated over --reps. --save DIR
         exports the trained drafter (an EAGLE-3 directory for drafter.drafter_path or vLLM).
  speed  proposals per second of ngram and suffix for a batch of live sequences over synthetic phrase text, and
         the suffix index's bytes per token (rlspec/bench/drafter_speed.py).
  replay what each model-free drafter would be accepted for at every position of GRPO-shaped rollouts of the
         embedded model (--epochs rollouts of --prompts x --group samples, T = 1): ngram, suffix, and the device
         lookup over the own text and with the siblings' (rlspec/bench/drafter_replay.py).

    python -m rlspec.bench drafter --rounds 6 --train-steps 60
    python -m rlspec.bench drafter --part speed --batch 32 --seq-len 300
    python -m rlspec.bench drafter --part replay --prompts 8 --group 8 --max-new-tokens 256
"""
from __future__ import annotations

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, math_prompts, smoke_model, timed_generate

NAME = "drafter"
HELP = ("online EAGLE-3 learning curve and tail speed-up (--part curve), model-free proposal speed (--part speed), "
        "model-free acceptance on GRPO-shaped rollouts (--part replay)")


def add_arguments(p) -> None:
    p.add_argument("--part", default="curve", choices=["curve", "speed", "replay"])
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--collect-prompts", type=int, default=16, help="training prompts per round (x4 samples)")
    p.add_argument("--train-steps", type=int, default=60, help="drafter optimizer steps per round")
    p.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts (the live batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="draft tokens per chain")
    p.add_argument("--save", default=None, help="curve: export the trained drafter to this directory")
    p.add_argument("--batch", type=int, default=32, help="speed: live sequences proposed for each step")
    p.add_argument("--group", type=int, default=4, help="speed, replay: samples per prompt")
    p.add_argument("--prompts", type=int, default=8, help="replay: prompts (x --group samples)")
    p.add_argument("--epochs", type=int, default=2, help="replay: rollouts of the same prompts, one after the other")
    p.add_argument("--seq-len", type=int, default=300, help="speed: prompt + completion tokens at the end")
    p.add_argument("--prompt-len", type=int, default=100, help="speed: prompt tokens")


def run(args) -> dict:
    if args.part == "replay":
        from rlspec.bench.drafter_replay import run_replay

        if args.smoke:
            args.dtype, args.prompts, args.group, args.max_new_tokens, args.epochs = SMOKE_DTYPE, 2, 2, 8, 1
            args.model = smoke_model(args.model, args.out)
        return run_replay(args)
    if args.part == "speed":
        from rlspec.bench.drafter_speed import run_speed

        if args.smoke:
            args.batch, args.group, args.seq_len, args.prompt_len = 4, 2, 30, 10
        return run_speed(args)
    if args.smoke:
        args.dtype, args.rounds, args.collect_prompts, args.train_steps = SMOKE_DTYPE, 1, 2, 2
        args.eval_prompts, args.max_new_tokens, args.reps = 2, 8, 1
        args.model = smoke_model(args.model, args.out)
    return curve(args)


def measure(engine, prompts, params, force_arm=None):
    """(tokens/s, accept_len, stats) of one generate call after a short warm-up; optionally forcing the arm."""
    if force_arm is not None:
        engine.speculation.force(force_arm)
    engine.generate(prompts, type(params)(**{**vars(params), "max_new_tokens": 8}))  # allocate caches, warm kernels
    engine.stats()
    _, tokens, dt = timed_generate(engine, prompts, params)
    s = engine.stats()
    return tokens / dt, s.get("rollout/accept_len", 1.0), s


def _learn(eng, trainer, held_out, eval_params, forced, args) -> list[dict]:
    from rlspec.rollout.types import SamplingParams

    collect_params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=4)
    curve = []
    for r in range(args.rounds + 1):
        _, acc, _ = measure(eng, held_out, eval_params, forced)
        curve.append({"round": r, "train_steps": trainer.stats.steps, "accept_len": acc,
                      "loss": trainer.stats.loss, "train_time_s": trainer.stats.train_time_s})
        print(f"[drafter] round {r}: {trainer.stats.steps} steps, {acc:.3f} accepted / verify", flush=True)
        if r == args.rounds:
            return curve
        collect_params.seed = 100 + r
        eng.generate(math_prompts(eng.tokenizer, args.collect_prompts, seed=100 + r), collect_params)
        trainer.train_steps(args.train_steps)
        trainer.publish()


def curve(args) -> dict:
    import torch

    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SamplingParams, SpecConfig

    torch.manual_seed(args.seed)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=args.k, online_training=False)  # trained below
    eng = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=args.dtype, max_model_len=512)
    plain = RolloutEngine(eng.model, eng.tokenizer, eos_token_ids=eng.eos_token_ids, max_model_len=512)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=1e-3, batch=8, window=64,
                                                            ttt_steps=3, publish_every=10**9,
                                                            min_tokens=1 if args.smoke else 1024))
    held_out = math_prompts(eng.tokenizer, args.eval_prompts, seed=12345)
    eval_params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    forced = Arm("eagle3", args.k, 1)
    learning = _learn(eng, trainer, held_out, eval_params, forced, args)
    if args.save:
        eng.export_drafter(args.save, metadata={"train_steps": trainer.stats.steps})
        print(f"[drafter] exported the trained drafter to {args.save}")

    def arm(engine, force, selector=False):
        def once(rep):
            eval_params.seed = 1 + rep
            if selector:
                engine.speculation.force(None)  # the selector chooses again
            tps, acc, s = measure(engine, held_out, eval_params, force)
            return {"tokens_per_s": tps, "accept_len": acc,
                    "spec_step_share": s.get("rollout/spec_step_share", 0.0) if selector else None}
        return once

    runs = harness.alternate({"no_spec": arm(plain, None), f"eagle3_forced_k{args.k}": arm(eng, forced),
                              "eagle3_selector": arm(eng, None, selector=True)}, args.reps)
    base = harness.medians({"b": [r["tokens_per_s"] for r in runs["no_spec"]]})["b"]
    rows = []
    for name, rs in runs.items():
        med = harness.medians({k: [r[k] for r in rs] for k in ("tokens_per_s", "accept_len")})
        rows.append({"config": name, "live_batch": args.eval_prompts, **med, "speedup": med["tokens_per_s"] / base,
                     "spec_step_share": rs[0]["spec_step_share"]})
    return {"part": "curve", "curve": learning, "rows": rows}


def plot(report: dict, path: str) -> None:
    if report["part"] != "curve":
        return
    pts = [(c["train_steps"], c["accept_len"]) for c in report["curve"]]
    harness.line_plot({"eagle3": pts}, "drafter optimizer steps", "accepted tokens per verify",
                      "EAGLE-3 drafter trained online on rollouts (held-out prompts, T=1)", path)
