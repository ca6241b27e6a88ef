"""DrafterIntake: where a learned drafter's training samples go, whoever computes them.

Two producers can fill a drafter trainer's buffer with the same samples (target features [n, 3H],
tokens, top-k next-token laws, policy version, temperature; docs/drafter_training.md#data-featurebuffer):
- the engine alone (scripts, warm start, a run without a trainer): Eagle3Drafter.finish banks every
  finished sample from the features it staged while decoding;
- a trainer, which runs the policy over every rollout anyway (its no-grad old-logprob forward):
  hooks on that pass (rollout/speculation/training/feature_tap.py) give the same features and laws, whatever
  backend sampled, vLLM included.
One loop trains on either. A trainer that feeds the drafter calls `claim()` before its first rollout:
from then on the backend's own banking is off, so no sample reaches the buffer twice.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DrafterIntake(Protocol):
    """What a producer of drafter training samples needs to know, and the one call it makes."""

    aux_layers: tuple[int, ...]  # HF hidden_states indices (i = output of decoder layer i-1) the features concatenate
    dtype: torch.dtype  # the features' dtype (the drafter's)

    @property
    def topk(self) -> int:
        """Entries of the next-token law kept per position (0: none; the loss then reads sampled tokens)."""

    def add(self, feats: torch.Tensor, token_ids: list[int], policy_version: int, dist, temperature: float) -> None:
        """One sample, as DrafterTrainer.add takes it (feats [n, 3H], n + 1 tokens, Dist with [n, ..] fields)."""

    def claim(self) -> None:
        """The caller feeds every sample from now on: the backend stops banking its own."""


class TrainerIntake:
    """A DrafterIntake over a drafter trainer (DrafterTrainer or ProcessTrainer).

    trainer: a callable returning the trainer now (None: nothing trains, samples are dropped), so an
    intake handed out once follows a trainer that is attached or detached later (a warm start's).
    on_claim: what claim() switches off (the engine's banking); None where nothing banks (vLLM)."""

    def __init__(self, trainer: Callable[[], object | None], aux_layers: tuple[int, ...], dtype: torch.dtype,
                 on_claim: Callable[[], None] | None = None):
        self._trainer, self.aux_layers, self.dtype, self._on_claim = trainer, tuple(aux_layers), dtype, on_claim
        self.claimed = False
        self.samples = 0  # samples handed to a trainer through here

    @property
    def topk(self) -> int:
        # a trainer without `topk` (the process proxy) is sent no laws, as the engine stages none for it
        return int(getattr(self._trainer(), "topk", 0) or 0)

    def add(self, feats, token_ids, policy_version, dist, temperature) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer.add(feats, token_ids, policy_version, dist, temperature)
            self.samples += 1

    def claim(self) -> None:
        if not self.claimed and self._on_claim is not None:
            self._on_claim()
        self.claimed = True
