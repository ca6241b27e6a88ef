"""Proposer and verifier: the two strategies a decode step plugs in (README.md#architecture).

A proposer turns the live rows into drafts (tokens, and for sampled drafts the distribution q each was
drawn from); a verifier turns the target's logits and those drafts into the accepted tokens, and says
with which law each emitted token was drawn. The engine's decode step is the same in every mode:

    schedule -> propose -> one target forward -> verify -> one host transfer -> commit

Lossless speculation is `SelectorProposer` (the selector's arm: no draft, a chain or a tree of the
suffix / n-gram / EAGLE-3 drafters) + `ExactVerifier` (rollout/speculation/verify.py). The lossy modes
(rollout/lossy/control.py: judge verification, Arbitrage step routing) are one more proposer and
verifier pair; both pairs are registered in rollout/registry.py's STRATEGIES and picked by the config
(rollout/engine.py, `build_strategies`): the engine never branches on them.

What a verifier wants on the host besides the accepted tokens (a lossy mode's token sources and
behaviour logprobs) rides in the step's one transfer: `StepVerdict.columns` are [B, c] device
tensors the engine appends to its own, and `provenance` reads them back from the host rows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlspec.rollout.registry import STRATEGIES
from rlspec.rollout.speculation.draft_batch import DraftBatch
from rlspec.rollout.speculation.drafters.base import NO_DRAFT, Draft, DraftTensors
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.speculation.verify import draw_plain, verify_chain, verify_tree
from rlspec.rollout.types import SamplingParams


# room(nodes per row) -> draft nodes each row may carry: within its token budget, the cache table and
# the KV blocks the pool can give (the engine's; a proposer asks before drafting)
Room = Callable[[list[int]], list[int]]


@dataclass
class StepVerdict:
    """A verifier's answer, on the device. A chain's path is 1..accepted, -1 after, and may be left None (nothing
    reads a chain's: its node j is its position j); a plain step (no row drafted) may leave path and accepted None
    (none accepted)."""

    path: torch.Tensor | None  # [B, N] long: accepted node indices by depth, -1 after the last
    accepted: torch.Tensor | None  # [B] long
    next_token: torch.Tensor  # [B] long: the token emitted after the accepted drafts
    columns: tuple[torch.Tensor, ...] = ()  # [B, c] extras for the step's host transfer (provenance)
    # the transfer's columns before those, as a kernel's draw wrote them (verify.Verdict)
    row: torch.Tensor | None = None


@dataclass
class Provenance:
    """Host lists per row, for the accepted drafts + the token after them: where each came from
    (rollout/types.py TOKEN_SOURCES) and the log of the probability it was emitted with; kept: rows
    whose whole drafted step a router kept."""

    sources: list[list[int]]
    behaviour: list[list[float]]
    kept: list[bool] = field(default_factory=list)


class Proposer(Protocol):
    extra_nodes: int  # draft nodes beyond the selector's arms it may propose (a whole drafted step)

    def start(self, seqs, params: SamplingParams, generator) -> None: ...

    def propose(self, live, arm: Arm, room: Room) -> tuple[list[Draft] | DraftTensors, list[bool] | None]:
        """Drafts for the live rows (DraftTensors: left on the device), and which rows carry a whole drafted step
        (None: none do)."""

    def after_commit(self, live, before: list[int], routed: list[bool] | None, kept: list[bool]) -> None: ...

    def finish(self, seq) -> None: ...


class Verifier(Protocol):
    hidden_layers: tuple[int, ...]  # target layers whose hidden states verify() reads

    def verify(self, logits: torch.Tensor, hiddens: dict, batch: DraftBatch, params: SamplingParams, generator,
               routed: list[bool] | None) -> StepVerdict: ...

    def provenance(self, columns: list[list[float]], accepted: list[int], lps: list[list[float]]) -> Provenance:
        """The host rows of StepVerdict.columns -> sources and behaviour logprobs (only when columns)."""

    def record(self, seqs) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class SelectorProposer:
    """The selector's arm, drafted by the engine's drafters (rollout/speculation/speculation.py)."""

    extra_nodes = 0

    def __init__(self, speculation):
        self.speculation = speculation

    def start(self, seqs, params, generator) -> None:
        pass

    def propose(self, live, arm: Arm, room: Room):
        if not arm.speculative:  # no room to ask for: the pending token's block is the step's
            return [NO_DRAFT] * len(live), None
        return self.speculation.draft(arm, live, room([arm.nodes] * len(live))), None

    def after_commit(self, live, before, routed, kept) -> None:
        pass

    def finish(self, seq) -> None:
        pass


class ExactVerifier:
    """Lossless: rejection sampling of chains and trees (greedy: the target's argmax), rollout/speculation/verify.py."""

    hidden_layers: tuple[int, ...] = ()

    def verify(self, logits, hiddens, batch: DraftBatch, params, generator, routed=None) -> StepVerdict:
        if batch.tokens.shape[1] == 1:  # no row drafted: verify_chain's draws, without a path
            token, row = draw_plain(logits[:, 0], params, generator)
            return StepVerdict(None, None, token, (), row)
        if batch.is_chain:
            v = verify_chain(logits, batch.tokens[:, 1:], batch.num_drafts, params, batch.q, generator)
            return StepVerdict(None, v.accepted, v.next_token, (), v.row)
        v = verify_tree(logits, batch.tokens, batch.children, params, batch.q, generator, batch.depth)
        return StepVerdict(v.path, v.accepted, v.next_token)

    def provenance(self, columns, accepted, lps) -> Provenance:
        raise AssertionError("ExactVerifier adds no columns: every token is the target's law")

    def record(self, seqs) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


def chain_verdict(v, N: int, columns: tuple[torch.Tensor, ...] = ()) -> StepVerdict:
    """A chain's Verdict (accepted, next_token) as a StepVerdict: its path is 1..accepted, -1 after."""
    return StepVerdict(chain_path(v.accepted, N), v.accepted, v.next_token, columns, v.row)


def chain_path(accepted: torch.Tensor, N: int) -> torch.Tensor:
    """[B, N] node path of a chain that accepted [B] drafts: 1..accepted, -1 after."""
    steps = torch.arange(1, N + 1, device=accepted.device)[None, :].expand(len(accepted), N)
    return torch.where(steps <= accepted[:, None], steps, -1)


@STRATEGIES.register("exact")
def _exact(spec, model, tokenizer, speculation) -> tuple[SelectorProposer, ExactVerifier]:
    return SelectorProposer(speculation), ExactVerifier()
