"""DrafterFeed: the trainer's own no-grad pass over its rollouts trains the learned drafter.

Every RL step the trainer runs the policy over prompt + completion of every rollout, without grad,
for the old logprobs (GRPO: TRL's `_get_per_token_logps_and_entropies` for the importance-sampling
correction, which SpecGRPOTrainer always turns on; PPO: `_experience`). That pass holds every hidden
state the EAGLE-3 drafter trains on, whichever backend sampled: a FeatureTap
(rollout/speculation/training/feature_tap.py) hooks it, and the samples go to the backend's drafter intake
(rollout/speculation/training/intake.py), the same DrafterTrainer loop the engine feeds when it runs alone.
So the vLLM backend's drafter learns from vLLM's rollouts without a second copy of the policy.

The switch: a feed exists when the backend offers an intake (a learned drafter trained online). It
claims the intake at the first rollout the trainer asks for (RolloutSource.generate), which turns the
backend's own banking off; only claimed rollouts are fed, so no sample is counted twice. Before that
(a warm start, a rollout_func sampling the engine directly) the engine banks its samples itself.
"""
from __future__ import annotations

import contextlib

import torch

from rlspec.rollout.backend import drafter_intake
from rlspec.rollout.speculation.training.feature_tap import FeatureTap, RowFeeder
from rlspec.rollout.types import SamplingParams


class DrafterFeed:
    """policy: the module the trainer's pass runs (a bare HF causal LM, or a PEFT model over one);
    intake: a DrafterIntake (rollout/speculation/training/intake.py)."""

    def __init__(self, policy: torch.nn.Module, intake):
        self.intake = intake
        self.tap = FeatureTap(policy, intake.aux_layers)
        self.fed = 0  # samples sent to the drafter's trainer

    @classmethod
    def for_backend(cls, backend, policy: torch.nn.Module) -> "DrafterFeed | None":
        """A feed when `backend` has a drafter intake, else None (nothing to feed, or it banks its own)."""
        intake = drafter_intake(backend)
        return None if intake is None else cls(policy, intake)

    @property
    def claimed(self) -> bool:
        return self.intake.claimed

    def claim(self) -> None:
        """From now on this feed supplies every sample: the backend stops banking its own."""
        self.intake.claim()

    @contextlib.contextmanager
    def around_pass(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                    params: SamplingParams, policy_version: int):
        """Around the trainer's no-grad forward over [B, S] rows (left-padded prompts, right-padded
        completions in the last completion_len columns), run whole or in row chunks, in order: the hooks
        exist only inside the block, and each forward's rows are fed as soon as it ran (its hidden states
        are not kept past that). params: the rollout's sampling (the drafter's target law)."""
        feeder = RowFeeder(self.tap, self.intake, input_ids, attention_mask, completion_len, params, policy_version)
        try:
            with self.tap.capture(feeder):
                yield
        finally:
            self.fed += feeder.fed
            self.tap.release()
