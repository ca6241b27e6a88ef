"""How many decode steps a GPU would not wait for the host before: the look-aheads on GRPO-shaped rollouts.

A step launched before the host read the step in front of it (a plain step's look-ahead, rollout/decode.py; a chain
drafted on the device, rollout/chains_ahead.py) keeps the device busy while the host reads, commits and launches;
every other step waits for that window (docs/runtime.md#host-step-budget). This counts them, `rollout/ahead_share`,
with the look-ahead switched on as on CUDA (on a CPU the host is the device: the counts, not the clocks, are the
figure). Rollouts of the embedded model on its math prompts, --prompts x --group samples at T = 1 with per-sample
keys (as the trainers pass them), more samples than rows (--rows), so a full batch with groups waiting is followed
by the long tail. Arms: plain decoding and `ngram_device` chains (selector "always"), each with the tail's carry of
rows that ended (`carry_ended`) and without it (every ended row ends a run of looked-ahead steps), and chains of a
cold EAGLE-3 drafter (its CUDA path: level graphs, emulated, and the catch-up run before the read). The carry
changes when steps are launched and which rows share them, not what they draw: in float32 a drafter's two arms give
the same samples (tests/rollout/test_look_ahead.py). In bfloat16 a step's batch and attention width differ between
them, which can round a logit differently and flip a draw near its boundary: `samples_differing` counts the samples
that differ from the drafter's first arm.

    python -m rlspec.bench ahead                 # ~3 min on 2 cores
"""
from __future__ import annotations

NAME = "ahead"
HELP = "share of decode steps launched before the host read the one in front (look-aheads), GRPO-shaped rollouts"
ARMS = [("plain", None, True), ("plain", None, False), ("ngram_device", "ngram_device", True),
        ("ngram_device", "ngram_device", False), ("eagle3", "eagle3", True)]
COLUMNS = ["drafter", "carry", "decode_steps", "ahead_share", "spec_step_share", "accept_len", "samples_differing"]


def add_arguments(p) -> None:
    from rlspec.bench.common import EMBEDDED

    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--rows", type=int, default=64, help="the engine's rows (max_num_seqs)")
    p.add_argument("--max-new-tokens", type=int, default=256)


def run(args) -> dict:
    import torch

    from rlspec.bench.common import SMOKE_DTYPE, math_prompts, smoke_model
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams, SpecConfig

    if args.smoke:
        args.dtype, args.prompts, args.group, args.rows, args.max_new_tokens = SMOKE_DTYPE, 2, 2, 2, 8
        args.model = smoke_model(args.model, args.out)
    else:  # the machine's two cores; a smoke run keeps its caller's count (a test worker's one thread)
        torch.set_num_threads(2)
    rows, reference = [], {}
    for drafter, name, carry in ARMS:
        spec = None if name is None else SpecConfig(drafter=name, selector="always", num_draft_tokens=4,
                                                    online_training=False)
        engine = RolloutEngine.from_pretrained(args.model, spec=spec, dtype=args.dtype, max_num_seqs=args.rows,
                                               max_model_len=1024)
        engine.look_ahead, engine.carry_ended = True, carry
        learned = engine.speculation.learned if engine.speculation is not None else None
        if learned is not None:  # the CUDA path: level graphs (emulated here) and the catch-up before the read
            learned.graph_mode, learned.early = "emulate", True
        prompts = math_prompts(engine.tokenizer, args.prompts, seed=args.seed)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group, seed=args.seed)
        keys = list(range(1000, 1000 + args.prompts * args.group))
        out = [r.completion_ids for r in engine.generate(prompts, params, sample_keys=keys)]
        reference.setdefault(drafter, out)  # the drafter's first arm
        stats = engine.stats()
        row = {"drafter": drafter, "carry": carry, "decode_steps": stats["rollout/decode_steps"],
               "ahead_share": stats["rollout/ahead_share"], "spec_step_share": stats["rollout/spec_step_share"],
               "accept_len": stats.get("rollout/accept_len"),
               "samples_differing": sum(a != b for a, b in zip(out, reference[drafter]))}
        rows.append(row)
        print(f"[ahead] {drafter}, carry {carry}: {row['ahead_share']:.0%} of {row['decode_steps']:.0f} decode steps "
              "launched ahead", flush=True)
    return {"rows": rows, "columns": COLUMNS}
