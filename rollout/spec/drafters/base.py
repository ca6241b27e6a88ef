"""The drafter protocol and registry: every drafter proposes a small token tree per live sequence.

A draft is a tree hanging below the sequence's pending token (node -1 = the pending token, whose
KV is not cached yet). A chain is the tree with parents [-1, 0, 1, ...]. Drafters are told about
new prompt groups and finished samples so that model-free ones can index them.

Deterministic drafters (n-gram, suffix) return no probabilities: verification then treats q as
one-hot, which is exact for them (reference.md section 1). A drafter that samples its tokens
(EAGLE-3 at temperature > 0) returns `q`, the processed distribution each token was drawn from;
verification then accepts with min(1, p/q) and resamples rejections from the residual.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.runtime.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index into tokens, -1 = the pending token
    # [len(tokens), V] float: the distribution each token was sampled from (siblings share their
    # parent's); None for deterministic proposals
    q: Any = None

    @classmethod
    def chain(cls, tokens: list[int], q=None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))


class Drafter(Protocol):
    name: str

    def begin(self, groups: list[list[Sequence]]) -> None:
        """New prompt groups were admitted (their n samples share the prompt)."""

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        """One draft per sequence with at most max_tokens[i] nodes and at most `width` children per node.
        An empty draft means "no speculation for this sequence this step"."""

    def finish(self, seq: Sequence) -> None:
        """A sample finished; model-free drafters index it for later prompts and epochs."""


_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build a registered drafter by name (importing the built-in ones on first use)."""
    from rollout.spec.drafters import ngram, suffix  # noqa: F401  (registration side effects)

    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)
