"""Evaluation and serving-style generation with any SpecConfig, lossy modes included.

Accuracy on held-out prompts of the embedded task (trainers/data.py's arithmetic, minus every
question the default training run sees) with a speculation setting against the target alone, on
the same prompts and seeds, plus rollout speed over the whole call and over its tail:

    python -m rlspec.eval --prompts 200 --samples 4 --spec drafter=suffix verification=judge \\
        judge_threshold=0.05 accept_off_policy=true

prints one JSON object: accuracy of both, their paired difference with a 95% interval and the
number of samples that would put 2 points outside the noise (docs/lossy.md#evaluation).
"""
from __future__ import annotations

import argparse
import json
import math
import time

TRAIN_SET = dict(num_examples=512, seed=0, max_operand=9, ops=("+",))  # configs/grpo_math.yaml's data
Z95 = 1.96


def heldout_math(n: int, seed: int = 1234, ops=("+", "-", "*"), max_operand: int = 20):
    """(conversations, answers): n embedded-task problems none of which is in the default training set."""
    from rlspec.trainers.data import make_math_dataset

    seen = {str(p) for p in make_math_dataset(**TRAIN_SET)["prompt"]}
    prompts, answers, k = [], [], 0
    while len(prompts) < n:
        ds = make_math_dataset(num_examples=4 * n, seed=seed + k, max_operand=max_operand, ops=tuple(ops))
        for p, a in zip(ds["prompt"], ds["answer"]):
            if str(p) not in seen and len(prompts) < n:
                seen.add(str(p))
                prompts.append(p)
                answers.append(a)
        k += 1
        if k > 50:
            raise ValueError(f"only {len(prompts)} held-out problems exist for ops={ops}, max_operand={max_operand}; "
                             "raise max_operand or ask for fewer prompts")
    return prompts, answers


def parse_spec(pairs: list[str]):
    """SpecConfig from key=value words, each value typed and checked as a `drafter.<key>=` override is."""
    from rlspec.config import build_from_words
    from rlspec.rollout.types import SpecConfig

    return build_from_words(SpecConfig, pairs, "--spec")


def evaluate(engine, prompt_ids: list[list[int]], answers: list[str], params) -> dict:
    """Generate, score with accuracy_reward, time the whole call and its tail. Returns a dict with
    accuracy, correct (per sample, prompt-major), tokens_per_s, tail_tokens_per_s and engine stats."""
    from rlspec.trainers.rewards import accuracy_reward

    engine.stats()  # start the counters here
    t0 = time.perf_counter()
    results = engine.generate(prompt_ids, params)
    wall = time.perf_counter() - t0
    trace = list(engine.batch_trace)
    stats = engine.stats()
    texts = [engine.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in results]
    gold = [answers[r.prompt_index] for r in results]
    correct = [float(c or 0.0) for c in accuracy_reward(texts, answer=gold)]
    tokens = sum(len(r.completion_ids) for r in results)
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "samples": len(correct),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "tail_tokens_per_s": tail_speed(trace, min(len(results), engine.max_num_seqs)),
            "stats": {k: v for k, v in stats.items() if not k.startswith("rollout/accept_hist")}}


def tail_speed(trace: list[tuple[float, int, int, bool]], rows: int) -> float:
    """Tokens per second over the decode steps run with a quarter of the rows or fewer still live."""
    tail = max(1, rows // 4)
    t_prev, secs, toks = 0.0, 0.0, 0
    for t, live, emitted, _ in trace:
        if live <= tail:
            secs += t - t_prev
            toks += emitted
        t_prev = t
    return toks / secs if secs > 0 else 0.0


def paired_difference(a: list[float], b: list[float], margin: float = 0.02) -> dict:
    """Accuracy of b minus a on the same samples: mean, standard error, 95% interval, and the samples
    n at which the interval's half-width would be `margin` (for the observed per-sample variance)."""
    n = len(a)
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / n
    var = sum((v - mean) ** 2 for v in d) / max(n - 1, 1)
    se = math.sqrt(var / n)
    return {"diff": mean, "se": se, "ci95": [mean - Z95 * se, mean + Z95 * se],
            "n_for_margin": math.ceil((Z95 ** 2) * var / margin ** 2) if var > 0 else 0, "margin": margin}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--spec", nargs="*", default=["drafter=suffix"], help="SpecConfig fields, key=value")
    args = ap.parse_args(argv)
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.types import SamplingParams, SpecConfig
    from rlspec.trainers.data import prompt_token_ids

    convs, answers = heldout_math(args.prompts)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.samples,
                            seed=args.seed)
    out = {}
    for name, spec in (("target", SpecConfig()), ("spec", parse_spec(args.spec))):
        engine = RolloutEngine.from_pretrained(args.model, spec=spec, max_model_len=512,
                                               max_num_seqs=args.max_num_seqs)
        try:
            out[name] = evaluate(engine, prompt_token_ids(engine.tokenizer, convs), answers, params)
        finally:
            engine.close()
    out["difference"] = paired_difference(out["target"]["correct"], out["spec"]["correct"])
    summary = {k: {m: v[m] for m in ("accuracy", "tokens_per_s", "tail_tokens_per_s")} for k, v in out.items()
               if k != "difference"}
    print(json.dumps({"args": vars(args), **summary, "difference": out["difference"]}, indent=2))
    return out


if __name__ == "__main__":
    main()
