"""Learning curve of the online EAGLE-3 drafter and its speedup in the long tail (live batch <= 4).

One run, the embedded model and data:
1. rounds of: collect rollouts on training prompts (features go to the drafter's buffer), train the
   drafter a fixed number of steps, then measure the accepted length on held-out prompts
   (T=1, a chain of 4, speculation forced on so the drafter is always measured);
2. at the end, tokens/s on held-out prompts at live batch <= 4: our engine without speculation vs
   with the trained drafter (chosen by the long-tail selector), same prompts, same settings.
Prints a table, writes JSON and a PNG of the curve.

    python scripts/bench_drafter.py --rounds 6 --train-steps 60 --out bench_out/drafter.json
"""
from __future__ import annotations

from common import line_plot, math_prompts, parser, table, write_json
from bench_engine import timed_generate


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--collect-prompts", type=int, default=16, help="training prompts per round (x4 samples)")
    p.add_argument("--train-steps", type=int, default=60, help="drafter optimizer steps per round")
    p.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts (the live batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="repetitions of the final tail measurement")
    p.add_argument("--out", default="bench_out/drafter.json")
    return p.parse_args(argv)


def measure(engine, prompts, params, force_arm=None):
    """(tokens/s, accept_len) of one generate call; optionally forcing the speculation arm."""
    if force_arm is not None:
        engine.speculation.force(force_arm)
    warm = type(params)(**{**vars(params), "max_new_tokens": 8})
    engine.generate(prompts, warm)  # allocate caches, warm kernels
    engine.stats()
    _, tokens, dt = timed_generate(engine, prompts, params)
    s = engine.stats()
    return tokens / dt, s.get("rollout/accept_len", 1.0), s


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from rollout.speculation.drafter_training import DrafterTrainer
    from rollout.engine import RolloutEngine
    from rollout.speculation.selectors.longtail import Arm
    from rollout.types import SamplingParams, SpecConfig

    torch.manual_seed(0)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=args.k, online_training=False)  # trained below
    eng = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=args.dtype, max_model_len=512)
    plain = RolloutEngine(eng.model, eng.tokenizer, eos_token_ids=eng.eos_token_ids, max_model_len=512)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=1e-3, batch=8, window=64, ttt_steps=3, publish_every=10**9))
    held_out = math_prompts(eng.tokenizer, args.eval_prompts, seed=12345)
    eval_params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    collect_params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=4)
    forced = Arm("eagle3", args.k, 1)
    curve = []
    for r in range(args.rounds + 1):
        _, acc, _ = measure(eng, held_out, eval_params, forced)
        curve.append({"round": r, "train_steps": trainer.stats.steps, "accept_len": acc,
                      "loss": trainer.stats.loss, "train_time_s": trainer.stats.train_time_s})
        print(table([curve[-1]], list(curve[-1])), flush=True)
        if r == args.rounds:
            break
        prompts = math_prompts(eng.tokenizer, args.collect_prompts, seed=100 + r)
        collect_params.seed = 100 + r
        eng.generate(prompts, collect_params, use_tqdm=True)
        trainer.train_steps(args.train_steps)
        trainer.publish()
    # the tail: live batch <= 4, plain vs forced speculation vs the selector's choice, round-robin
    runs = {"no_spec": [], "eagle3_forced_k%d" % args.k: [], "eagle3_selector": []}
    for rep in range(args.reps):
        eval_params.seed = 1 + rep
        runs["no_spec"].append(measure(plain, held_out, eval_params)[:2])
        runs["eagle3_forced_k%d" % args.k].append(measure(eng, held_out, eval_params, forced)[:2])
        eng.speculation.force(None)  # the selector chooses again
        tps, acc, s = measure(eng, held_out, eval_params)
        runs["eagle3_selector"].append((tps, acc, s.get("rollout/spec_step_share", 0.0)))
    base = sum(r[0] for r in runs["no_spec"]) / args.reps
    tail = [{"config": name, "live_batch": args.eval_prompts, "tokens_per_s": sum(r[0] for r in rs) / len(rs),
             "speedup": sum(r[0] for r in rs) / len(rs) / base, "accept_len": sum(r[1] for r in rs) / len(rs),
             "spec_step_share": sum(r[2] for r in rs) / len(rs) if len(rs[0]) > 2 else None}
            for name, rs in runs.items()]
    result = {"config": vars(args), "curve": curve, "tail": tail}
    print(table(tail, list(tail[0])))
    write_json(args.out, result)
    plot(curve, args.out.replace(".json", ".png"))
    return result


def plot(curve, path):
    pts = [(c["train_steps"], c["accept_len"]) for c in curve]
    line_plot({"eagle3": pts}, "drafter optimizer steps", "accepted tokens per verify (k=4)",
              "EAGLE-3 drafter trained online on rollouts (held-out prompts, T=1)", path)


if __name__ == "__main__":
    main()
