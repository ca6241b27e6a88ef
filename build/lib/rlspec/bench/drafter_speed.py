"""Speed of the model-free drafters (`python -m rlspec.bench drafter --part speed`): proposals per second for a
batch of live sequences.

Synthetic groups (prompts x samples) whose text is drawn from a bank of short phrases, so that n-gram and suffix
matches are frequent and every code path (index growth, lookups, tries, trees) runs. Each step proposes for the
whole live batch and then appends 1-3 tokens to every sequence (as accepted tokens would), until each holds
--seq-len tokens; the timed part is `propose`, which includes indexing the new tokens. Suffix runs two epochs over
the same texts: the second sees the first's history (its best case). Also the suffix index's bytes per token.
"""
from __future__ import annotations

import random
import time
import tracemalloc


def phrase_text(rng: random.Random, bank: list[list[int]], n: int, noise: float = 0.2) -> list[int]:
    """n tokens: phrases from the bank, with some fresh random tokens between them."""
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(bank) if rng.random() > noise else [rng.randrange(32_000)]
    return out[:n]


def make_groups(rng, bank, batch: int, group: int, prompt_len: int) -> tuple[list, list]:
    """Groups of sequences (one first token each) and the full text each will grow into."""
    from rlspec.rollout.runtime.sequence import Sequence

    groups, texts = [], []
    for p in range(batch // group):
        prompt = phrase_text(rng, bank, prompt_len)
        groups.append([Sequence(p, i, list(prompt), 10**6) for i in range(group)])
        texts.append([phrase_text(rng, bank, 10**4 // 20) for _ in range(group)])
    return groups, texts


def run_epoch(drafter, groups, texts, seq_len: int, k: int, width: int, rng) -> dict:
    seqs = [s for g in groups for s in g]
    text = {id(s): t for g, ts in zip(groups, texts) for s, t in zip(g, ts)}
    for s in seqs:
        s.append(text[id(s)][:1], [0.0], set())
    t0 = time.perf_counter()
    drafter.begin(groups)
    begin_s = time.perf_counter() - t0
    spent, proposals, drafted = 0.0, 0, 0
    while len(seqs[0].prompt_ids) + len(seqs[0].completion_ids) < seq_len:
        t0 = time.perf_counter()
        drafts = drafter.propose(seqs, [k * width] * len(seqs), width)
        spent += time.perf_counter() - t0
        proposals += len(seqs)
        drafted += sum(map(len, drafts))
        step = rng.randint(1, 3)
        for s in seqs:
            n = len(s.completion_ids)
            s.append(text[id(s)][n:n + step], [0.0] * step, set())
    t0 = time.perf_counter()
    for s in seqs:
        drafter.finish(s)
    finish_s = time.perf_counter() - t0
    return {"proposals_per_s": proposals / spent, "us_per_seq": 1e6 * spent / proposals,
            "mean_draft_len": drafted / proposals, "begin_ms": 1e3 * begin_s, "finish_ms": 1e3 * finish_s}


def traced_bytes(fill) -> int:
    """Bytes still allocated after fill() runs (what it built and keeps)."""
    tracemalloc.start()
    kept = fill()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return held


def suffix_memory(rng, bank, doc_len: int = 500, n_docs: int = 128) -> dict:
    """Bytes per token: an indexed window (the global one, or a prompt with live samples) and a
    cold history (prompts between visits keep raw tokens only)."""
    from rlspec.rollout.runtime.sequence import Sequence
    from rlspec.rollout.speculation.drafters.base import make_drafter
    from rlspec.rollout.speculation.drafters.ngram import NgramIndex

    docs = [phrase_text(rng, bank, doc_len) for _ in range(n_docs)]

    def fill_index():
        index = NgramIndex(make_drafter("suffix").anchors)
        for d in docs:
            index.add(d)
        return index

    def fill_cold():
        drafter = make_drafter("suffix", global_docs=1)
        for p, d in enumerate(docs):
            for i in range(4):
                s = Sequence(p, i, [p, p + 1, p + 2], 10**6)
                s.append(d, [0.0] * len(d), set())
                drafter.finish(s)
        return drafter

    tokens = len(docs) * doc_len
    indexed = traced_bytes(fill_index) / tokens
    cold = (traced_bytes(fill_cold) - traced_bytes(lambda: make_drafter("suffix", global_docs=1))) / (4 * tokens)
    return {"indexed_bytes_per_token": indexed, "cold_bytes_per_token": cold}


def run_speed(args) -> dict:
    from rlspec.rollout.runtime.sequence import Sequence
    from rlspec.rollout.speculation.drafters.base import make_drafter

    rng = random.Random(args.seed)
    bank = [[rng.randrange(32_000) for _ in range(rng.randint(2, 8))] for _ in range(100)]
    rows = []
    for name in ("ngram", "suffix"):
        for width in (1, 2):
            drafter = make_drafter(name)
            groups, texts = make_groups(rng, bank, args.batch, args.group, args.prompt_len)
            for epoch in range(2 if name == "suffix" else 1):
                fresh = [[Sequence(s.prompt_index, s.sample_index, s.prompt_ids, 10**6) for s in g] for g in groups]
                rows.append({"drafter": name, "width": width, "epoch": epoch,
                             **run_epoch(drafter, fresh, texts, args.seq_len, args.k, width, rng)})
    memory = suffix_memory(rng, bank, *((50, 8) if args.smoke else (500, 128)))
    print(f"suffix memory: indexed {memory['indexed_bytes_per_token']:.0f} bytes/token, "
          f"cold history {memory['cold_bytes_per_token']:.1f} bytes/token")
    return {"part": "speed", "rows": rows, "memory": memory}
