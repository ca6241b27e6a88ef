"""The `oracle` section: rollouts with a drafter of known acceptance, against plain decoding (greedy, T = 0).

`OracleDrafter` (benchmark-only, never registered) proposes the target's own greedy continuation, recorded by a
plain rollout of the same prompts first, with each position's token replaced by a random one with probability
1 - a. The replacements are fixed per position (one uniform per position: kept where it is below a), so every
call over the same prompts drafts the same chains: the repetitions of a row time the same steps, the warm-up
meets every graph key the timed calls will, and a higher a keeps a superset of a lower one's positions. A
rejected position is emitted by the target itself and never drafted again, so each verify still accepts a run of
positions kept independently with probability a, and a chain of k yields E_k = sum_{i=0..k} a^i tokens on
average. The model's greedy choice is made bf16-stable (`make_greedy_stable`): with plain random weights a verify
and a decode step round differently, the output drifts from the recorded continuation within a few tokens and
nothing is accepted.

Each arm is timed at two lengths (`new_tokens`: short, long). Their difference is the decode loop alone: the
prefill and the call's set-up cancel, as in `python -m rlspec.bench host`, and that is what the formula
(predict.py) models. A call of 48 tokens spent ~30 ms of its 130-360 ms outside its decode steps on the H200
(docs/gpu.md#the-oracle-check-speculation-timed-on-a-gpu), which weighs more the fewer steps speculation leaves.
The whole long call's speedup is reported beside it."""
from __future__ import annotations

import random

from rlspec.bench.gpucheck.common import (build_hf, engine_over, fits, graph_captures, make_greedy_stable,
                                         random_prompts, release, timed_calls)
from rlspec.bench.gpucheck.predict import expected_tokens


class OracleDrafter:
    """Chains from `reference` (prompt tuple -> greedy completion), each position's token kept where its fixed
    uniform is below `accept` (a replacement drawn once per position otherwise). It drafts on the device as the
    model-free device drafter does (a table of the chains there, `propose_tensors`), so its chains are looked ahead
    where the engine's are (rollout/chains_ahead.py: `propose_ahead`)."""

    name = "oracle"

    def __init__(self, reference: dict[tuple, list[int]], vocab: int, accept: float, seed: int = 0):
        rng = random.Random(seed)
        self.reference = reference
        self.rows = {p: i for i, p in enumerate(reference)}  # prompt -> its row of the table
        # per prompt and position: the uniform that decides, and the token that replaces the reference's
        self.draws = {p: [(rng.random(), _other(rng, t, vocab)) for t in ref] for p, ref in reference.items()}
        self.cache = self.table = None
        self._last = None  # the last proposal's (table rows, positions) on the device
        self.accept = accept

    @property
    def accept(self) -> float:
        return self._accept

    @accept.setter
    def accept(self, a: float) -> None:
        """The chains at this acceptance, built once (proposing is then a slice: the drafter's host time is ~0,
        as the formula's d = 0 assumes)."""
        self._accept = a
        self.chains = {p: [t if u < a else other for t, (u, other) in zip(ref, self.draws[p])]
                       for p, ref in self.reference.items()}
        self.table = None  # made again on the device at the next call's start

    def start(self, seqs, cache, params=None, generator=None, history=None) -> None:
        import torch

        self.cache = cache
        if self.table is None or self.table.device != cache.table.device:
            # past a chain's end 0s (never within a row's budget); a last row of 0s for a prompt without a chain
            width = max(map(len, self.chains.values())) + 1
            self.table = torch.tensor([c + [0] * (width - len(c)) for c in self.chains.values()] + [[0] * width],
                                      dtype=torch.long, device=cache.table.device)

    def begin(self, groups) -> None:
        pass

    def propose_tensors(self, seqs, max_tokens: list[int], width: int):
        """Each row's chain from its position on (the pending token is completion_ids[-1]), gathered on the
        device."""
        rows = [self.rows.get(tuple(s.prompt_ids), len(self.rows)) for s in seqs]
        sent = self.cache.ints(rows + [len(s.completion_ids) for s in seqs])
        return self._gather(sent[:len(seqs)], sent[len(seqs):], max(max_tokens, default=0), list(max_tokens))

    def propose_ahead(self, seqs, depth: int, ahead):
        """The step after one the host has not read (an `Ahead`): each row's position moved on by that step's
        accepted drafts and its next token."""
        rows, at = self._last
        return self._gather(rows, at + ahead.accepted + 1, depth, [depth] * len(seqs))

    def appended(self, seqs) -> None:
        pass

    def _gather(self, rows, at, D: int, caps: list[int]):
        import torch

        from rlspec.rollout.speculation.drafters.base import DraftTensors

        self._last = (rows, at)
        cols = (at[:, None] + torch.arange(D, device=at.device)).clamp(max=self.table.shape[1] - 1)
        return DraftTensors(self.table[rows[:, None], cols][:, None, :], None, caps)

    def finish(self, seq) -> None:
        pass

    def propose(self, seqs, max_tokens: list[int], width: int):
        from rlspec.rollout.speculation.drafters.base import Draft

        out = []
        for seq, cap in zip(seqs, max_tokens):
            n = len(seq.completion_ids)  # the pending token is completion_ids[-1]: drafts start after it
            out.append(Draft.chain(self.chains.get(tuple(seq.prompt_ids), [])[n:n + cap]))
        return out


def _other(rng: random.Random, token: int, vocab: int) -> int:
    """A random token other than `token` (a replacement that happened to match would be accepted)."""
    t = rng.randrange(vocab - 1)
    return t + (t >= token)


def run(cfg: dict, device, dtype, left, save) -> dict:
    """cfg: shape, batches, accepts, num_draft_tokens, prompt_len, new_tokens ([short, long]), repeats.

    Every graph key is captured before any timing (one untimed call of each length per arm and batch), each
    figure is the median of `repeats` timed calls with their decode steps and captures, and the acceptances run
    in an order rotated per batch (not always low to high on the same engine)."""
    from rlspec.bench.harness import rotation
    from rlspec.rollout.types import SpecConfig

    k, (short, long), B = cfg["num_draft_tokens"], cfg["new_tokens"], max(cfg["batches"])
    out = {"shape": cfg["shape"], "num_draft_tokens": k, "temperature": 0.0, "new_tokens": [short, long],
           "rows": []}
    why = fits(cfg["shape"], B, cfg["prompt_len"] + long + k + 8, 3, device, dtype)
    if why:
        return {**out, "skipped": why}
    hf = build_hf(cfg["shape"], dtype, device)
    make_greedy_stable(hf)
    length = cfg["prompt_len"] + long + k + 8
    prompts = random_prompts(B, cfg["prompt_len"], hf.config.vocab_size, seed=4)
    plain = engine_over(hf, device, dtype, B, length)
    ref = plain.generate(prompts, _greedy(long))  # the reference continuations; also sizes the pool
    reference = {tuple(r.prompt_ids): list(r.completion_ids) for r in ref}
    drafter = OracleDrafter(reference, hf.config.vocab_size, 1.0)
    spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=k, online_training=False)
    oracle = engine_over(hf, device, dtype, B, length, spec=spec, drafter=drafter)
    del hf
    release(device)
    for b in cfg["batches"]:  # the warm-up: the same calls as the timed ones (fixed chains), untimed
        for n in (short, long):
            plain.generate(prompts[:b], _greedy(n))
            for a in cfg["accepts"]:
                drafter.accept = a
                oracle.generate(prompts[:b], _greedy(n))
    out["warmup_captures"] = dict(plain=graph_captures(plain), oracle=graph_captures(oracle))
    for i, b in enumerate(cfg["batches"]):
        ids = prompts[:b]
        base = _lengths(plain, ids, (short, long), device, cfg["repeats"])
        for a in rotation(list(cfg["accepts"]), i):
            if left() <= 0:
                save(out)
                return out
            drafter.accept = a
            call = _lengths(oracle, ids, (short, long), device, cfg["repeats"])
            out["rows"].append(_row(b, a, k, (short, long), base, call, reference))
            r = out["rows"][-1]
            print(f"  batch {b} a={a}: decode x{r['decode_speedup']:.2f} plain (whole call x{r['speedup']:.2f}), "
                  f"accept_len {r['accept_len']:.2f} (expected {r['expected_accept_len']:.2f}), step "
                  f"{r['step_ms']:.2f} ms (plain {r['plain_step_ms']:.2f}), steps {r['decode_steps']}, the loop's "
                  f"tokens a step {r['loop_accept_len']:.2f}, launched ahead {r['ahead_share']}, captures in "
                  f"timed calls {r['timed_captures']}", flush=True)
        save(out)
    return out


def _greedy(n: int):
    from rlspec.rollout.types import SamplingParams

    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def _lengths(engine, ids, lengths, device, repeats: int) -> dict:
    """timed_calls at each length: {n: its result}."""
    return {n: timed_calls(engine, lambda n=n: engine.generate(ids, _greedy(n)), device, repeats) for n in lengths}


def _row(b: int, a: float, k: int, lengths, base: dict, call: dict, reference: dict) -> dict:
    """One (batch, a): the decode loop's figures from the difference of the two lengths, the long call's whole."""
    from statistics import median

    from rlspec.rollout.metrics import ACCEPT_LEN, AHEAD_SHARE

    short, long = lengths
    spec_s = call[long]["seconds"] - call[short]["seconds"]
    plain_s = base[long]["seconds"] - base[short]["seconds"]
    steps = median(call[long]["decode_steps"]) - median(call[short]["decode_steps"])
    plain_steps = median(base[long]["decode_steps"]) - median(base[short]["decode_steps"])
    res, tokens = call[long]["value"], b * long
    # tokens a verify over the difference: each call's rows verified (new - 1) tokens' worth (the first is the
    # prefill's) at its measured tokens per verify
    verifies = [b * (n - 1) / call[n]["stats"][ACCEPT_LEN] for n in lengths]
    return dict(batch=b, accept=a, expected_accept_len=expected_tokens(a, k),
                decode_speedup=plain_s / spec_s if spec_s > 0 else None,
                speedup=base[long]["seconds"] / call[long]["seconds"],
                tok_s=tokens / call[long]["seconds"], plain_tok_s=tokens / base[long]["seconds"],
                accept_len=b * (long - short) / (verifies[1] - verifies[0]),
                accept_len_call=call[long]["stats"][ACCEPT_LEN],
                # tokens a row gained per step of the loop, which runs until its slowest row is done: below
                # accept_len by what the rows' spread costs a batch of fixed lengths, not the engine
                loop_accept_len=(long - short) / steps if steps > 0 else None,
                ahead_share=call[long]["stats"].get(AHEAD_SHARE),  # the steps launched before the host read the last
                step_ms=spec_s / steps * 1e3 if steps > 0 else None,
                plain_step_ms=plain_s / plain_steps * 1e3 if plain_steps > 0 else None,
                call_overhead_ms=(call[long]["seconds"] - spec_s / steps * median(call[long]["decode_steps"])) * 1e3
                if steps > 0 else None,
                same_as_reference=sum(r.completion_ids == reference[tuple(r.prompt_ids)] for r in res) / len(res),
                **{f"{key}_{n}": call[n][src] for n in lengths for key, src in
                   (("seconds_all", "seconds_all"), ("decode_steps", "decode_steps"), ("captures", "captures"))},
                **{f"plain_seconds_all_{n}": base[n]["seconds_all"] for n in lengths},
                **{f"plain_decode_steps_{n}": base[n]["decode_steps"] for n in lengths},
                decode_steps=call[long]["decode_steps"],
                **{f"timed_{what}": sum(call[n][f"timed_{what}"] + base[n][f"timed_{what}"] for n in lengths)
                   for what in ("captures", "compiles")})
