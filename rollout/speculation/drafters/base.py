"""The drafter protocol and registry: every drafter proposes a small token tree per live sequence.

A draft is a tree hanging below the sequence's pending token (node -1 = the pending token, whose
KV is not cached yet). A chain is the tree with parents [-1, 0, 1, ...]. Drafters are told about
new prompt groups and finished samples so that model-free ones can index them.

Deterministic drafters (n-gram, suffix) return no probabilities: verification then treats q as
one-hot, which is exact for them (docs/verification.md). A drafter that samples its tokens
(EAGLE-3 at temperature > 0) returns `q`, the processed distribution each token was drawn from;
verification then accepts with min(1, p/q) and resamples rejections from the residual.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.registry import DRAFTERS


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index into tokens, -1 = the pending token
    # [len(tokens), V] float: the distribution each token was sampled from, given the siblings listed
    # before it (i.i.d. siblings share one q; siblings drawn without replacement each have q with the
    # earlier ones removed, renormalised); None for deterministic proposals
    q: Any = None

    @classmethod
    def chain(cls, tokens: list[int], q=None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))


NO_DRAFT = Draft()  # the empty draft, shared (drafts are read, never changed)


@dataclass
class DraftTensors:
    """Every row's draft at once with its tokens still on the device, as a learned drafter draws them: W branches of
    D tokens below each row's pending token (a chain: W = 1), row i cut to `caps[i]` nodes. The decode step verifies
    them where they are (draft_batch.py), so it never waits for the drafter to read its tokens back: what the host
    needs to lay out the verify, each row's node count, it knows beforehand. `to_drafts()` gives the same drafts as
    Drafts (for callers that read the tokens).

    Row i keeps min(W, caps[i]) branches of caps[i] // that many tokens each, branch after branch: the most nodes
    within its cap, as wide as the drafter drew."""

    ids: torch.Tensor  # [B, W, D] long: target token ids
    q: torch.Tensor | None  # [B, W, D, V] float: what each token was drawn from, as Draft.q; None: greedy drafts
    caps: list[int]  # most nodes each row keeps (0: the row drafts nothing)
    # [B] on the device, or None: a further limit the host has not read (a stop rule's, in chains drafted for a step
    # launched ahead: rollout/chains_ahead.py takes the smaller)
    kept: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.caps)

    def shapes(self) -> list[tuple[int, int]]:
        """(branches, tokens a branch) each row keeps."""
        W, D = self.ids.shape[1:]
        return [(w, min(c // w, D)) if (w := min(W, c)) else (0, 0) for c in self.caps]

    def counts(self) -> list[int]:
        """Nodes each row keeps."""
        return [w * d for w, d in self.shapes()]

    def layout(self) -> list[Draft]:
        """Each row's tree, its tokens the nodes' indices into ids.view(B, W * D) (what the verify gathers); rows of
        one shape share one read-only Draft."""
        D = self.ids.shape[2]
        return [_laid_branches(w, n, D) for w, n in self.shapes()]

    def to_drafts(self) -> list[Draft]:
        """The same drafts as Drafts, their tokens on the host (one copy) and q per row on the device."""
        B, W, D = self.ids.shape
        flat = self.ids.view(B, W * D).tolist()
        out = []
        for i, (d, (w, n)) in enumerate(zip(self.layout(), self.shapes())):
            q = None if self.q is None or not w else self.q[i, :w, :n].reshape(w * n, -1)
            out.append(Draft([flat[i][k] for k in d.tokens], list(d.parents), q))
        return out


@functools.lru_cache(maxsize=None)
def branch_layout(w: int, n: int, D: int) -> tuple[list[int], list[int]]:
    """w branches of n tokens below the root, branch after branch: (index of each node's token in a row's W x D
    draws flattened, its parent node). Shared read-only lists: copy before changing them."""
    index = [b * D + j for b in range(w) for j in range(n)]
    parents = [-1 if j == 0 else b * n + j - 1 for b in range(w) for j in range(n)]
    return index, parents


@functools.lru_cache(maxsize=None)
def _laid_branches(w: int, n: int, D: int) -> Draft:
    """branch_layout as a Draft (DraftTensors.layout): shared, read-only."""
    return Draft(*branch_layout(w, n, D))


@dataclass
class Ahead:
    """A chain step launched but not read yet, as the drafting of its successor sees it (rollout/chains_ahead.py),
    all on the device but `top`: emitted [B, N + 1] its accepted drafts then its next token, accepted [B], budget
    [B] each row's tokens still allowed before it (0: a row that ended), stops the stop token ids, start [B] each
    row's cache length after it (where the successor's pending token sits), top a host bound of max(start) and
    advance [B] what each row's completion grows by."""

    emitted: torch.Tensor
    accepted: torch.Tensor
    budget: torch.Tensor
    stops: torch.Tensor
    start: torch.Tensor
    top: int
    advance: torch.Tensor  # [B] tokens each row's completion grows by (accepted + 1; 0 for a row that ended)


@runtime_checkable
class Drafter(Protocol):
    """What the engine calls on every drafter. One file per drafter, registered with
    `@DRAFTERS.register(name)` on a factory `(target=None, spec=None, **overrides) -> Drafter`.

    Optional, for checkpoints (Speculation.state_dict): `state_dict() -> dict` of what the drafter
    carries from one generate() call to the next (plain Python values and CPU tensors) and
    `load_state_dict(state)`. A drafter without them is taken to carry nothing. Optional too:
    `abandon(seq)`, a partial round stopped seq unfinished (drop its per-sample state, index nothing); `settle()`,
    do the work `finish` deferred (the engine calls it once a step's device work is launched); `start(seqs, cache,
    params, generator, history)`, a generate call begins (LearnedDrafter.start: the engine's cache, its device and
    funnel)."""

    name: str

    def begin(self, groups: list[list[Sequence]]) -> None:
        """New prompt groups were admitted (their n samples share the prompt)."""

    def propose(self, seqs: list[Sequence], max_tokens: list[int], width: int) -> list[Draft]:
        """One draft per sequence with at most max_tokens[i] nodes and at most `width` children per node.
        An empty draft means "no speculation for this sequence this step"."""

    # Optional: `propose_tensors(seqs, max_tokens, width) -> DraftTensors`, the same drafts left on the device; the
    # decode step takes it where a drafter has it (Speculation.draft). With it, `propose_ahead(seqs, depth, ahead:
    # Ahead) -> DraftTensors | None` and `appended(seqs)`: a chain for the step after one the host has not read, from
    # that step's results on the device (None: not this step); the host has committed that step
    # (rollout/chains_ahead.py); and, where a drafter can look ahead only at times, `ahead_ready(seqs) -> bool`.

    def finish(self, seq: Sequence) -> None:
        """A sample finished; model-free drafters index it for later prompts and epochs."""


@runtime_checkable
class LearnedDrafter(Drafter, Protocol):
    """A drafter that runs a network on the target's hidden states (EAGLE-3). Beyond `Drafter`, the
    engine gives it the target's features, a few layers of the shared KV cache and the call's
    sampling state, and its weights can be retrained online and exported."""

    aux_layers: tuple[int, ...]  # target layers whose hidden states it reads (HF hidden_states indices)
    extra_kv_layers: int  # KV layers it keeps as extra layers of the engine's cache (they move with rows)
    version: int  # weights version; changes when a trainer publishes new weights
    backlog_seconds: float  # of the latest propose: catching up on steps it sat out (the selector leaves it out)
    early_span: object  # device time of work for the next proposal run before the step's read (runtime.device.Span)

    def side_buffers(self) -> dict:
        """Per-position data it stages in the KV pool's blocks (kv_cache.SideSpec: name -> (shape, dtype)),
        so the data follows the tokens held, is shared with a prompt and freed with the blocks."""

    def start(self, seqs: list[Sequence], cache, params, generator, history=None, draws=None) -> None:
        """A generate call begins: its sequences, the engine's PagedKVCache, SamplingParams and generator;
        history: the rows' token sets (rollout/runtime/history.py) when a repetition penalty is on, else
        None. A sampled q should be penalised with them (the row's set plus the draft's own tokens before
        each position) to stay close to p; exactness only needs q to be the law the draft was drawn from.
        draws: the call's KeyedDraws when it has per-sample keys (sampled drafts may draw from them, purpose
        DRAFT, so a sample's drafts depend on its key, not its batch), else None."""

    def observe_prefill(self, groups: list[list[Sequence]], feats) -> None:
        """feats [P, T, 3H]: the target's features at every prompt position of each admitted group."""

    def observe_resume(self, seqs: list[Sequence], feats) -> None:
        """Preempted sequences were prefilled again: feats [B, T, 3H] of positions 0..cache_len-1 of each."""

    def observe_verify(self, seqs: list[Sequence], feats, path, accepted, ahead: int = 0, tokens=None, start=None,
                       top: int = 0, logits=None) -> None:
        """A verify was launched (the host has not read it): feats [B, N+1, 3H] at every verified node; path [B, N]
        a tree's accepted nodes (-1 after; None: a chain's, 1..accepted, or a plain step's) and accepted [B] their
        counts, on the device (None: a plain step, which keeps the pending node); ahead: plain steps launched before
        this one that the host has not committed (the step's positions are each row's cache_len + ahead on); tokens
        [B, N+1]: the step's emitted tokens (the accepted drafts, then the next one), when a chain or the general
        step verified. A chain step that may have been launched ahead (rollout/chains_ahead.py) gives start [B], the
        rows' positions on the device (top: a host bound of their largest), and its logits [B, N+1, V], read for a
        distillation target now (the next step's launch overwrites them), not at `observe_commit`. Stage, and may
        start, what the next proposal reads, without reading the device."""

    def observe_commit(self, seqs: list[Sequence], accepted: list[int], logits) -> None:
        """The host read the step `observe_verify` saw: accepted [B] drafts per row; logits [B, N+1, V] float32: the
        target's raw logits at every node (a distillation target), valid until the next step is launched (None: the
        step gave them to `observe_verify`)."""

    def evict(self, seq: Sequence) -> None:
        """seq was preempted: its blocks, with the drafter's KV layer and staged data, are gone; rebuild the
        layer when seq is back (observe_resume restages the features first)."""

    def set_policy_version(self, version: int) -> None:
        """The target's weights changed: tag data from now on with this version."""

    def set_stop_rule(self, rule: str) -> None:
        """How the next proposal ends its chains early: "none", "max_conf" or "entropy"."""

    def attach(self, trainer) -> None:
        """Send finished samples' features to trainer.add(...) and take new weights from trainer.latest()
        (None: no trainer; stage no training data)."""

    def swap_latest(self) -> None:
        """Take the attached trainer's newest published weights now, if they are newer."""

    def network(self):
        """The drafter network (an Eagle3Model) as it drafts now, for export."""


def make_drafter(name: str, target=None, spec=None, **overrides) -> Drafter:
    """Build a registered drafter by name; the factory takes what it needs (the target model for a
    learned drafter, the SpecConfig for its settings) and keyword overrides for its own fields. A SpecConfig asking
    a drafter registered `chains_only` for trees is a clear error here, when the engine is built."""
    if spec is not None and spec.tree_width > 1 and DRAFTERS.meta(name).get("chains_only"):
        raise ValueError(f"drafter {name} drafts chains; tree_width={spec.tree_width} asks for trees: set "
                         "drafter.tree_width=1, or use drafter=ngram or suffix (trees from the matches' counts, on "
                         "the host)")
    return DRAFTERS.build(name, target=target, spec=spec, **overrides)
