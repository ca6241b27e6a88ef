"""Warm start: train an EAGLE-3 drafter on the target's own rollouts before RL begins, then export it.

A cold drafter is useless until online training catches up; this gives the run a head start.
Rounds of: sample rollouts of the training prompts with the target (T=1, GRPO-shaped groups; the
target's hidden states go straight into the drafter's buffer), then train the drafter. The result is
an EAGLE-3 directory (vLLM/SGLang format) that a run loads with `drafter.drafter_path=<out>`:

    python scripts/warm_start_drafter.py --rounds 8 --out outputs/drafter_warm
    python -m rlspec.train config=grpo_math.yaml drafter.drafter=eagle3 drafter.drafter_path=outputs/drafter_warm
"""
from __future__ import annotations

from common import math_prompts, parser, write_json


def main(argv=None) -> str:
    p = parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompts-per-round", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=80, help="drafter optimizer steps per round")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--out", default="outputs/drafter_warm")
    args = p.parse_args(argv)

    from rlspec.export import export_drafter
    from rollout.speculation.drafter_training import DrafterTrainer
    from rollout.engine import RolloutEngine
    from rollout.speculation.selectors.longtail import OFF
    from rollout.types import SamplingParams, SpecConfig

    spec = SpecConfig(drafter="eagle3", online_training=False, draft_vocab_size=args.draft_vocab_size)
    eng = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=args.dtype, max_model_len=512)
    eng.speculation.force(OFF)  # collect only: plain decoding, hidden states still captured
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, publish_every=10**9))
    log = []
    for r in range(args.rounds):
        prompts = math_prompts(eng.tokenizer, args.prompts_per_round, seed=1000 + r)
        eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group,
                                             seed=r), use_tqdm=True)
        loss = trainer.train_steps(args.train_steps)
        log.append({"round": r, "loss": loss, "buffer_tokens": trainer.buffer.tokens, "steps": trainer.stats.steps})
        print(f"[warm-start] round {r}: loss {loss:.3f}, {trainer.buffer.tokens} buffered tokens", flush=True)
    path = export_drafter(trainer.model, args.out, target=eng.model.cfg.hf_config,
                          metadata={"warm_start": log, "train_steps": trainer.stats.steps})
    write_json(f"{args.out}/warm_start_log.json", {"config": vars(args), "rounds": log})
    print(f"[warm-start] exported the drafter to {path}")
    return path


if __name__ == "__main__":
    main()
