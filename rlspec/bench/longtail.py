"""The long-tail rollout workload of `python -m rlspec.bench rollout --workload longtail`.

P prompts of the embedded math data x G samples at T=1 until EOS (or the cap), so completion lengths are
long-tailed and the live batch drains over time, as in RL. In one process it measures transformers `generate`,
the engine without speculation and each speculative configuration: all are warmed up first, then every
repetition draws fresh prompts and runs every config on them in rotating order; figures are totals over the
repetitions. Per config: wall time, tokens/s overall and per phase (full batch: more than --tail-live sequences
live, default a quarter; tail: the rest), accepted length, share of steps that speculated. Sampled outputs
differ between configs (different random streams, same law), so compare tokens/s, which depends less on which
lengths were drawn than wall time does.
"""
from __future__ import annotations

import time

from rlspec.bench import harness
from rlspec.bench.common import hf_model, math_prompts, timed_generate, tokenizer_and_eos

CONFIGS = {
    # name: (drafter, k, width, selector); "always" forces speculation at every live batch size
    "engine": ("none", 0, 1, "fixed"),
    "ngram": ("ngram", 4, 1, "fixed"),
    "ngram_device": ("ngram_device", 4, 1, "fixed"),  # the own and siblings' texts looked up on the device
    "ngram_device-always": ("ngram_device", 4, 1, "always"),
    "suffix_device": ("suffix_device", 4, 1, "fixed"),  # suffix, the device lookup for the rows it leaves empty
    "suffix": ("suffix", 4, 1, "fixed"),
    "suffix-k8": ("suffix", 8, 1, "fixed"),
    "suffix-tree": ("suffix", 6, 2, "fixed"),
    "suffix-always": ("suffix", 4, 1, "always"),
    "adaptive": ("suffix", 8, 1, "adaptive"),
    # the learned drafter (trained weights from --drafter-path, not trained further while measured)
    "eagle3": ("eagle3", 4, 1, "fixed"),
    "eagle3-always": ("eagle3", 4, 1, "always"),
    "eagle3-k1-always": ("eagle3", 1, 1, "always"),  # the shortest chains: the cheapest verify (the tail's ceiling)
    "eagle3-tree-always": ("eagle3", 8, 2, "always"),
    "auto": ("auto", 4, 1, "fixed"),  # suffix + ngram + eagle3, chosen per batch (the adaptive selector)
    # the same with an untrained EAGLE-3 drafter (no --drafter-path, no training): what `auto` starts from; its
    # gate keeps the drafter out until evidence says it pays (docs/selectors.md#learned-drafter-gate)
    "auto-untrained": ("auto", 4, 1, "adaptive"),
}
UNTRAINED = ("auto-untrained",)  # learned configs that run without --drafter-path


def phase_rates(trace, total_seqs: int, tail_live: int | None = None) -> dict:
    """Tokens/s while more than `tail_live` sequences are live (full) and after (tail); tail_live defaults to a
    quarter of the sequences."""
    out = {"full": [0, 0.0], "tail": [0, 0.0]}
    prev = 0.0
    limit = tail_live or max(1, total_seqs // 4)
    for t, live, emitted, _ in trace:
        phase = "tail" if live <= limit else "full"
        out[phase][0] += emitted
        out[phase][1] += t - prev
        prev = t
    return {f"{k}_tokens_per_s": (n / s if s else 0.0) for k, (n, s) in out.items()} | {
        f"{k}_seconds": s for k, (_, s) in out.items()}


def make_engine(name, path, dtype, tokenizer, eos, rows, drafter_path=None):
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.types import SpecConfig

    drafter, k, width, selector = CONFIGS[name]
    learned = drafter in ("eagle3", "auto") and name not in UNTRAINED
    if learned and not drafter_path:
        raise SystemExit(f"config {name} needs a trained drafter: --drafter-path DIR (an EAGLE-3 export, e.g. "
                         "`python -m rlspec.bench drafter --save DIR`)")
    spec = SpecConfig(drafter=drafter, num_draft_tokens=max(k, 1), tree_width=width, selector=selector,
                      drafter_path=drafter_path if learned else None, online_training=False)
    return RolloutEngine(loader.load_model(path, dtype=dtype), tokenizer, spec=spec, max_model_len=1024,
                         max_num_seqs=rows, eos_token_ids=eos)


def run_engine(eng, prompts, params, tail_live: int | None = None) -> dict:
    """One timed rollout: tokens, wall time and the per-phase figures of its batch trace."""
    eng.stats()
    out, tokens, wall = timed_generate(eng, prompts, params)
    trace = list(eng.batch_trace)
    s = eng.stats()
    return {"tokens": tokens, "wall_s": wall, "trace": trace,
            "accept_len": s.get("rollout/accept_len", 1.0), "spec_share": s.get("rollout/spec_step_share", 0.0),
            **phase_rates(trace, len(out), tail_live)}


def hf_generator(path, dtype, params, seed):
    import torch

    tok, model = hf_model(path, dtype, padding_side="left")

    def gen(ps) -> dict:
        batch = tok.pad({"input_ids": [p for p in ps for _ in range(params.n)]}, return_tensors="pt")
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=params.max_new_tokens, do_sample=True, top_k=0,
                                 temperature=params.temperature, pad_token_id=tok.pad_token_id)
        wall = time.perf_counter() - t0
        new = out[:, batch["input_ids"].shape[1]:]
        eos = tok.eos_token_id
        lens = [int((row != eos).cumprod(0).sum()) + int((row == eos).any()) for row in new]
        return {"tokens": sum(lens), "wall_s": wall}

    return gen


def aggregate(name: str, reps: list[dict]) -> dict:
    """Sum tokens and seconds over repetitions (per phase too): a rate over all the work done."""
    tok, wall = sum(r["tokens"] for r in reps), sum(r["wall_s"] for r in reps)
    row = {"config": name, "reps": len(reps), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
           "tokens_per_s_reps": [round(r["tokens"] / r["wall_s"], 1) for r in reps]}
    if "trace" in reps[0]:
        for ph in ("full", "tail"):
            n = sum(r[f"{ph}_tokens_per_s"] * r[f"{ph}_seconds"] for r in reps)
            secs = sum(r[f"{ph}_seconds"] for r in reps)
            row[f"{ph}_tokens_per_s"] = n / secs if secs else 0.0
            row[f"{ph}_seconds"] = secs
        row["accept_len"] = sum(r["accept_len"] for r in reps) / len(reps)
        row["spec_share"] = sum(r["spec_share"] for r in reps) / len(reps)
    return row


def _speedups(rows: list[dict]) -> None:
    """Each config's tokens/s (overall, full batch, tail) over the plain engine's."""
    ref = next((r for r in rows if r["config"] == "engine"), None)
    for r in rows if ref else ():
        r["speedup_vs_engine"] = r["tokens_per_s"] / ref["tokens_per_s"]
        for ph in ("full", "tail"):
            if r.get(f"{ph}_tokens_per_s") and ref.get(f"{ph}_tokens_per_s"):
                r[f"{ph}_speedup"] = r[f"{ph}_tokens_per_s"] / ref[f"{ph}_tokens_per_s"]


def run_longtail(args) -> dict:
    import torch

    from rlspec.rollout.runtime.model.fetch import fetch_model
    from rlspec.rollout.types import SamplingParams

    torch.manual_seed(0)
    path = fetch_model(args.model)
    tokenizer, eos = tokenizer_and_eos(path, args.dtype)
    repeat = args.workload == "repeat"  # greedy continuations that repeat the prompt: where a drafter clearly pays
    make_prompts = repeat_prompts if repeat else math_prompts
    params = SamplingParams(temperature=0.0 if repeat else 1.0, max_new_tokens=args.max_new_tokens,
                            n=1 if repeat else args.group, seed=args.seed)
    rows = args.prompts * args.group
    runners = {name: (hf_generator(path, args.dtype, params, args.seed) if name == "hf"
                      else make_engine(name, path, args.dtype, tokenizer, eos, rows, args.drafter_path))
               for name in args.configs}  # build everything first, then warm each up on the same prompts
    warm = make_prompts(tokenizer, 2, seed=8)
    for name, r in runners.items():
        r(warm) if name == "hf" else r.generate(warm, params)

    def arm(name):
        def once(rep):  # fresh prompts each repetition: no config sees a prompt twice
            prompts = make_prompts(tokenizer, args.prompts * (args.group if repeat else 1), seed=100 + rep)
            return runners[name](prompts) if name == "hf" else run_engine(runners[name], prompts, params,
                                                                          args.tail_live)
        return once

    results = harness.alternate({name: arm(name) for name in args.configs}, args.reps,
                                lambda n, rep, r: print(f"[longtail] rep {rep} {n}: "
                                                        f"{r['tokens'] / r['wall_s']:.1f} tok/s", flush=True))
    table_rows = [aggregate(name, reps) for name, reps in results.items()]
    _speedups(table_rows)
    traces = {name: [list(x) for x in reps[0]["trace"]] for name, reps in results.items() if "trace" in reps[0]}
    return {"workload": args.workload, "rows": table_rows, "traces": traces,
            "columns": ["config", "tokens", "wall_s", "tokens_per_s", "speedup_vs_engine", "full_speedup",
                        "tail_speedup", "accept_len", "spec_share"]}


_PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank, then runs back home to sleep under the old oak "
    "tree while the sun sets behind the hills.",
    "Water boils at one hundred degrees Celsius at sea level, and at lower temperatures on high mountains, because the "
    "air pressure there is lower.",
    "A train leaves the station at nine in the morning and travels at sixty miles per hour until it reaches the city "
    "by noon.",
    "The library opens at eight, closes at six, and lends each reader up to five books for three weeks at a time.",
]


def repeat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts asking to repeat a passage verbatim (rotating passages from `seed`)."""
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this text exactly, twice, and nothing else:\n"
                                     + _PASSAGES[(seed + i) % len(_PASSAGES)]}],
        add_generation_prompt=True, return_dict=False) for i in range(n)]


def plot(report: dict, path: str) -> None:
    """Tokens/s per config (overall, full batch, tail) and each config's live batch over its first rollout."""
    rows, traces = report["rows"], report["traces"]
    with harness.png(path, 1, 2, dpi=110, figsize=(12, 4)) as (fig, (a, b)):
        x = range(len(rows))
        for off, key in ((-0.25, "tokens_per_s"), (0.0, "full_tokens_per_s"), (0.25, "tail_tokens_per_s")):
            a.bar([i + off for i in x], [r.get(key, 0) for r in rows], width=0.25,
                  label=key.replace("_tokens_per_s", "").replace("tokens_per_s", "overall"))
        a.set_xticks(list(x), [r["config"] for r in rows], rotation=30, ha="right")
        a.set_ylabel("tokens/s")
        a.legend()
        a.set_title("long-tail rollout throughput")
        for name, tr in traces.items():
            b.step([t for t, *_ in tr], [live for _, live, *_ in tr], where="post", label=name)
        b.set_xlabel("seconds into the rollout")
        b.set_ylabel("live sequences")
        b.legend()
        b.set_title("live batch over time")
