"""Test drafters with known behaviour, so speculation is exercised whatever the model says."""
from __future__ import annotations

import random

import torch

from rlspec.rollout.speculation.drafters.base import Draft


class ScriptedDrafter:
    """Proposes chains (or trees) mixing the target's own greedy continuation with random tokens.

    `oracle(seq)` gives tokens the target would likely emit; a share of proposals is corrupted so
    that verification sees accepts, rejections and partial acceptances in one batch. It counts the
    shapes it proposed so that tests can prove they were exercised.
    """

    name = "scripted"

    def __init__(self, vocab: int, oracle=None, corrupt: float = 0.3, seed: int = 0, tree: bool = False,
                 one_hot_q: bool = False):
        self.vocab, self.oracle, self.corrupt, self.tree = vocab, oracle, corrupt, tree
        self.one_hot_q = one_hot_q  # chains described by their one-hot q: verified by the rule for sampled drafts
        self.rng = random.Random(seed)
        self.finished = 0
        self.multi = 0  # drafts of >= 2 tokens
        self.branched = 0  # trees: drafts whose root has two children
        self.deep = 0  # trees of two children below the root and a grandchild

    def begin(self, groups) -> None:
        pass

    def finish(self, seq) -> None:
        self.finished += 1

    def _chain(self, seq, n: int) -> list[int]:
        base = self.oracle(seq, n) if self.oracle else []
        base = (base + [self.rng.randrange(self.vocab) for _ in range(n)])[:n]
        return [t if self.rng.random() > self.corrupt else self.rng.randrange(self.vocab) for t in base]

    def propose(self, seqs, max_tokens, width):
        out = []
        for s, cap in zip(seqs, max_tokens):
            n = self.rng.randint(0, cap) if cap else 0
            self.multi += n >= 2
            if not self.tree or width == 1 or n < 2:
                toks = self._chain(s, n)
                hot = self.one_hot_q and n > 0
                out.append(Draft.chain(toks, torch.nn.functional.one_hot(torch.tensor(toks), self.vocab).float()
                                       if hot else None))
                continue
            # two branches below the root: the oracle chain and a random one
            a = self._chain(s, (n + 1) // 2)
            b = [self.rng.randrange(self.vocab) for _ in range(n - len(a))]
            toks = b[:1] + a + b[1:]
            parents = [-1] + [-1] + list(range(1, len(a))) + ([0] + list(range(len(a) + 1, n - 1)) if len(b) > 1 else [])
            parents = parents[:n]
            self.branched += 1
            self.deep += n >= 3
            out.append(Draft(toks, parents))
        return out


class OracleDrafter:
    """Deterministic proposals (verified with a one-hot q) that the target often accepts.

    `ranked(prefix)` gives the next tokens by decreasing target probability after a completion prefix
    (from tests.rollout.law_helpers.hf_exact_law). Each step a sequence gets a draft of random length
    1..cap (ragged rows in every batch); with width w the root gets w children, the oracle's top-1,
    top-2, ..., each continued along the top-1 path; every token is replaced by a random one with
    probability `corrupt`, so rejections happen at every depth and sibling. It counts the shapes it
    proposed so that tests can prove they were exercised.
    """

    name = "oracle"

    def __init__(self, ranked: dict, vocab: int, corrupt: float = 0.2, seed: int = 0):
        self.ranked, self.vocab, self.corrupt = ranked, vocab, corrupt
        self.rng = random.Random(seed)
        self.multi = 0  # drafts of >= 2 tokens
        self.branched = 0  # drafts whose root has >= 2 children

    def begin(self, groups) -> None:
        pass

    def finish(self, seq) -> None:
        pass

    def propose(self, seqs, max_tokens, width):
        out = []
        for s, cap in zip(seqs, max_tokens):
            if cap == 0:
                out.append(Draft())
                continue
            n = self.rng.randint(1, cap)
            w = min(width, n)
            tokens, parents = [], []
            for b in range(w):
                prefix = tuple(s.completion_ids)
                for d in range(n // w + (b < n % w)):
                    options = self.ranked.get(prefix) or [self.rng.randrange(self.vocab)]
                    t = options[min(b, len(options) - 1)] if d == 0 else options[0]
                    if self.rng.random() < self.corrupt:
                        t = self.rng.randrange(self.vocab)
                    parents.append(-1 if d == 0 else len(tokens) - 1)
                    tokens.append(t)
                    prefix += (t,)
            self.multi += n >= 2
            self.branched += w >= 2
            out.append(Draft(tokens, parents))
        return out
