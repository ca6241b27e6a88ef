"""trainers.weight_sync: the engine follows the policy after a sync, and unchanged policies are not re-sent."""
from __future__ import annotations

import pytest
import torch

from rollout.engine import RolloutEngine
from rollout.types import SamplingParams
from trainers.weight_sync import WeightSyncer, iter_named_weights, sync_weights, unwrap_model


class _Wrapper(torch.nn.Module):
    """Stands in for DDP / DeepSpeedEngine: the real model sits in `.module`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def _greedy(engine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0].completion_ids


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.fixture
def engine(tiny_llama, char_tokenizer):
    return RolloutEngine.from_hf_model(tiny_llama, char_tokenizer, max_model_len=64, max_num_seqs=4)


def test_unwrap_peels_nested_wrappers(tiny_llama):
    assert unwrap_model(_Wrapper(_Wrapper(tiny_llama))) is tiny_llama
    names = [name for name, _ in iter_named_weights(_Wrapper(tiny_llama))]
    assert names == [name for name, _ in tiny_llama.named_parameters()]
    assert not any(name.startswith("module.") for name in names)


def test_sync_makes_the_engine_follow_the_policy(tiny_llama, char_tokenizer, engine):
    prompt = char_tokenizer("What is 3 + 4?")["input_ids"]
    _perturb(tiny_llama)
    fresh = RolloutEngine.from_hf_model(tiny_llama, char_tokenizer, max_model_len=64, max_num_seqs=4)
    assert engine.policy_version == 0
    sync_weights(_Wrapper(tiny_llama), engine)
    assert engine.policy_version == 1
    # Same weights -> same greedy rollout as an engine built from the perturbed policy directly.
    assert _greedy(engine, prompt) == _greedy(fresh, prompt)
    result = engine.generate([prompt], SamplingParams(max_new_tokens=2, seed=0))[0]
    assert result.policy_version == 1


def test_syncer_skips_an_unchanged_policy(tiny_llama, engine):
    syncer = WeightSyncer(engine, synced_step=0)  # engine built from the step-0 policy
    assert syncer.maybe_sync(tiny_llama, step=0) is False and engine.policy_version == 0
    assert syncer.maybe_sync(tiny_llama, step=1) is True and engine.policy_version == 1
    assert syncer.maybe_sync(tiny_llama, step=1) is False and engine.policy_version == 1  # grad accumulation
    assert syncer.maybe_sync(tiny_llama, step=2) is True and engine.policy_version == 2
    assert syncer.num_syncs == 2 and syncer.total_time_s > 0


def test_unknown_engine_state_forces_the_first_sync(tiny_llama, engine):
    syncer = WeightSyncer(engine)  # synced_step=None: an engine built elsewhere
    assert syncer.maybe_sync(tiny_llama, step=0) is True and engine.policy_version == 1
