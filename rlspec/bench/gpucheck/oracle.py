"""The `oracle` section: rollouts with a drafter of known acceptance, against plain decoding (greedy, T = 0).

`OracleDrafter` (benchmark-only, never registered) proposes the target's own greedy continuation, recorded by a
plain rollout of the same prompts first, with each drafted token replaced by a random one with probability
1 - a. At T = 0 a chain's i-th draft is then accepted with probability a^i (each earlier one survived), so the
rollout's expected tokens per verify are sum_{i=0..k} a^i, and its speedup checks the formula docs/gpu.md
predicts from the `spec_costs` section. The model's greedy choice is made bf16-stable (`make_greedy_stable`):
with plain random weights a verify and a decode step round differently, the output drifts from the recorded
continuation within a few tokens and nothing is accepted. Measured acceptance and the share of rows that
reproduced the reference are reported beside a."""
from __future__ import annotations

import random

from rlspec.bench.gpucheck.common import (build_hf, engine_over, fits, graph_captures, make_greedy_stable,
                                         random_prompts, release, timed_calls)
from rlspec.bench.gpucheck.predict import expected_tokens


class OracleDrafter:
    """Chains from `reference` (prompt tuple -> greedy completion), each token kept with probability `accept`."""

    name = "oracle"

    def __init__(self, reference: dict[tuple, list[int]], vocab: int, accept: float, seed: int = 0):
        self.reference, self.vocab, self.accept = reference, vocab, accept
        self.rng = random.Random(seed)

    def begin(self, groups) -> None:
        pass

    def finish(self, seq) -> None:
        pass

    def propose(self, seqs, max_tokens: list[int], width: int):
        from rlspec.rollout.speculation.drafters.base import Draft

        out = []
        for seq, cap in zip(seqs, max_tokens):
            ref = self.reference.get(tuple(seq.prompt_ids), [])
            n = len(seq.completion_ids)  # the pending token is completion_ids[-1]: drafts start after it
            chain = ref[n:n + cap]
            out.append(Draft.chain([t if self.rng.random() < self.accept else self._other(t) for t in chain]))
        return out

    def _other(self, token: int) -> int:
        """A random token other than `token` (a replacement that happened to match would be accepted)."""
        t = self.rng.randrange(self.vocab - 1)
        return t + (t >= token)


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, accepts, num_draft_tokens, prompt_len, new_tokens, repeats.

    Every graph key is captured before any timing (one untimed call per batch and acceptance), each row is the
    median of `repeats` timed calls with their decode steps and captures, and the acceptances run in an order
    rotated per batch (not always low to high on the same engine)."""
    from rlspec.bench.harness import rotation
    from rlspec.rollout.metrics import ACCEPT_LEN
    from rlspec.rollout.types import SamplingParams, SpecConfig

    k, new, B = cfg["num_draft_tokens"], cfg["new_tokens"], max(cfg["batches"])
    out = {"shape": cfg["shape"], "num_draft_tokens": k, "temperature": 0.0, "rows": []}
    why = fits(cfg["shape"], B, cfg["prompt_len"] + new + k + 8, 3, device, dtype)
    if why:
        return {**out, "skipped": why}
    hf = build_hf(cfg["shape"], dtype, device)
    make_greedy_stable(hf)
    length = cfg["prompt_len"] + new + k + 8
    prompts = random_prompts(B, cfg["prompt_len"], hf.config.vocab_size, seed=4)
    greedy = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    plain = engine_over(hf, device, dtype, B, length)
    ref = plain.generate(prompts, greedy)  # the reference continuations; also sizes the pool for the timed calls
    reference = {tuple(r.prompt_ids): list(r.completion_ids) for r in ref}
    drafter = OracleDrafter(reference, hf.config.vocab_size, 1.0)
    spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=k, online_training=False)
    oracle = engine_over(hf, device, dtype, B, length, spec=spec, drafter=drafter)
    del hf
    release(device)
    oracle.generate(prompts, greedy)
    for b in cfg["batches"]:  # the warm-up: every key of every row captured before any timing
        plain.generate(prompts[:b], greedy)
        for a in cfg["accepts"]:
            drafter.accept = a
            oracle.generate(prompts[:b], greedy)
    out["warmup_captures"] = dict(plain=graph_captures(plain), oracle=graph_captures(oracle))
    for i, b in enumerate(cfg["batches"]):
        ids = prompts[:b]
        base = timed_calls(plain, lambda: plain.generate(ids, greedy), device, cfg["repeats"])
        plain_tok_s = b * new / base["seconds"]
        for a in rotation(list(cfg["accepts"]), i):
            if left() <= 0:
                save(out)
                return out
            drafter.accept = a
            call = timed_calls(oracle, lambda: oracle.generate(ids, greedy), device, cfg["repeats"])
            res, stats = call["value"], call["stats"]
            same = sum(r.completion_ids == reference[tuple(r.prompt_ids)] for r in res) / len(res)
            out["rows"].append(dict(batch=b, accept=a, tok_s=b * new / call["seconds"], plain_tok_s=plain_tok_s,
                                    speedup=plain_tok_s and b * new / call["seconds"] / plain_tok_s,
                                    accept_len=stats.get(ACCEPT_LEN), expected_accept_len=expected_tokens(a, k),
                                    same_as_reference=same, seconds_all=call["seconds_all"],
                                    decode_steps=call["decode_steps"], captures=call["captures"],
                                    timed_captures=call["timed_captures"], plain_seconds_all=base["seconds_all"],
                                    plain_decode_steps=base["decode_steps"], plain_captures=base["captures"]))
            r = out["rows"][-1]
            print(f"  batch {b} a={a}: {r['tok_s']:.0f} tok/s, x{r['speedup']:.2f} plain, accept_len "
                  f"{r['accept_len']} (expected {r['expected_accept_len']:.2f}), steps {r['decode_steps']}, "
                  f"captures in timed calls {r['timed_captures']}", flush=True)
        save(out)
    return out
