"""Rollouts as one padded batch: the layout trainers run their forward passes over (TRL's, PPO's), prompts
left-padded and completions right-padded, so every completion starts at the same column."""
from __future__ import annotations

import torch

from rlspec.rollout.types import RolloutResult


def pad_rollouts(results: list[RolloutResult], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask [B, P + C], C): prompts left-padded, completions right-padded."""
    P = max(len(r.prompt_ids) for r in results)
    C = max(1, max(len(r.completion_ids) for r in results))
    ids = torch.full((len(results), P + C), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(results):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids[i, P - p:P] = torch.tensor(r.prompt_ids, dtype=torch.long)
        ids[i, P:P + c] = torch.tensor(list(r.completion_ids), dtype=torch.long)
        mask[i, P - p:P + c] = 1
    return ids, mask, C
