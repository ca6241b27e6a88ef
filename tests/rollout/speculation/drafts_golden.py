"""Model-free drafters' drafts, recorded: a change to how they find matches must leave every draft as it was.

`replay()` drives the n-gram and suffix drafters the way the engine does, with no model: GRPO groups of a few
prompts x samples over two epochs (a prompt returns, so the suffix drafter's history and global window serve), each
sample growing by 1-3 tokens a step from a small-vocabulary source that repeats itself (so matches of every anchor
length occur), samples finishing at different steps, budgets from 0 to 6 nodes and widths 1 to 3. It returns every
draft of every call as (tokens, parents). `python -m tests.rollout.speculation.drafts_golden` wrote
drafts_golden.json from the drafters as they were before their lookups were made faster
(tests/rollout/speculation/test_drafts_unchanged.py compares every later run against it).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

GOLDEN = Path(__file__).with_name("drafts_golden.json")
# (drafter, constructor overrides): the defaults, and the options that change how a match is measured
DRAFTERS = [("ngram", {}), ("ngram", {"spec_factor": 0.5}), ("ngram", {"min_ngram": 1, "max_ngram": 3}),
            ("suffix", {}), ("suffix", {"spec_factor": 0.4, "min_prob": 0.0}), ("suffix", {"anchors": (4, 2)})]


def _source(rng: random.Random, phrases: list[list[int]]):
    """Tokens that mostly repeat a few phrases (with small edits), now and then a fresh token."""
    while True:
        phrase = rng.choice(phrases)
        for t in phrase:
            yield t if rng.random() > 0.08 else rng.randrange(3, 40)
        if rng.random() < 0.2:
            yield rng.randrange(3, 40)


def replay(name: str, overrides: dict, seed: int = 0) -> list[list]:
    """Every draft of every propose call of one scripted run: [[tokens, parents], ...] per call."""
    from rlspec.rollout.runtime.sequence import Sequence
    from rlspec.rollout.speculation.drafters.base import make_drafter

    rng = random.Random(seed)
    drafter = make_drafter(name, **overrides)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    phrases = [[rng.randrange(3, 40) for _ in range(rng.randrange(2, 7))] for _ in range(6)]
    calls = []
    for epoch in range(2):
        groups = [[Sequence(p, s, list(prompt), rng.randrange(20, 60)) for s in range(4)]
                  for p, prompt in enumerate(prompts)]
        sources = {id(s): _source(rng, phrases) for g in groups for s in g}
        drafter.begin(groups)
        live = [s for g in groups for s in g]
        while live:
            for s in live:
                n = min(rng.randrange(1, 4), s.remaining)
                s.append([next(sources[id(s)]) for _ in range(n)], [0.0] * n, set())
            for s in [s for s in live if s.finished]:
                drafter.finish(s)
            getattr(drafter, "settle", lambda: None)()  # what the engine defers to its next launch, done here
            live = [s for s in live if not s.finished]
            if live:
                width = rng.choice([1, 1, 2, 3])
                drafts = drafter.propose(live, [rng.randrange(0, 7) for _ in live], width)
                calls.append([[d.tokens, d.parents] for d in drafts])
    return calls


def record() -> dict:
    return {f"{name} {json.dumps(kw, sort_keys=True)}": replay(name, kw) for name, kw in DRAFTERS}


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
