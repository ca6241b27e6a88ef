"""rlspec.trainers.weight_sync: the engine follows the policy after a sync, unchanged policies are not re-sent, ZeRO-3
gathers are grouped under a byte bound and wrapper name parts are stripped (the real ZeRO-3 and FSDP runs:
tests/distributed)."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.types import SamplingParams
from rlspec.trainers.weight_sync import WeightSyncer, gather_groups, hf_name, iter_named_weights, sync_weights, unwrap_model


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


def test_gather_groups_are_bounded_consecutive_and_complete():
    """Groups keep the parameters' order, never exceed the bucket unless one parameter alone does, and
    hold every parameter once."""
    sizes = [100, 300, 200, 900, 50, 50, 400]  # float32 elements -> 4 bytes each
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    groups = gather_groups(named, bucket_bytes=2000)
    assert [[name for name, _ in g] for g in groups] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5", "p6"]]
    for group in groups:
        nbytes = sum(p.numel() * 4 for _, p in group)
        assert nbytes <= 2000 or len(group) == 1  # p3 (3600 bytes) is a group of its own
    assert len(gather_groups(named, bucket_bytes=10**9)) == 1
    with pytest.raises(ValueError, match="sync_bucket_mb"):
        gather_groups(named, bucket_bytes=0)


def test_wrapper_name_parts_are_stripped_and_the_sync_still_lands(tiny_llama, char_tokenizer, engine):
    """Activation-checkpoint wrappers (as FSDP1 and accelerate insert them) and torch.compile put extra
    components in parameter names; the sync strips them and the engine follows the policy."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = [name for name, _ in tiny_llama.named_parameters()]
    _perturb(tiny_llama)
    fresh = RolloutEngine.from_hf_model(tiny_llama, char_tokenizer, max_model_len=64, max_num_seqs=4)
    layers = tiny_llama.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
    wrapped = torch.compile(tiny_llama)  # an OptimizedModule: names gain "_orig_mod."; nothing compiles until called
    raw = [name for name, _ in wrapped.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in raw) and all(n.startswith("_orig_mod.") for n in raw)
    assert hf_name("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert [name for name, _ in iter_named_weights(wrapped)] == plain
    seconds, gathers = sync_weights(wrapped, engine)
    assert gathers == 0 and engine.policy_version == 1
    prompt = char_tokenizer("What is 3 + 4?")["input_ids"]
    assert _greedy(engine, prompt) == _greedy(fresh, prompt)


# ---- every runtime tensor written exactly once per sync (rollout/runtime/model/loader.py WriteLedger) ----
def _named(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach()) for name, p in model.named_parameters()]


def test_a_sync_missing_a_tensor_is_refused_and_the_version_stays(tiny_llama, engine):
    from rlspec.rollout.errors import WeightSyncError

    named = [(n, t) for n, t in _named(tiny_llama) if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightSyncError, match=r"1 of the \d+ runtime tensors were never written: "
                                              r"\['model.layers.1.mlp.up_proj.weight'\]"):
        engine.load_weights(named)
    assert engine.policy_version == 0


def test_a_tensor_written_twice_in_one_sync_is_refused(tiny_llama, engine):
    from rlspec.rollout.errors import WeightSyncError

    named = _named(tiny_llama)
    with pytest.raises(WeightSyncError, match=r"'model.layers.0.self_attn.k_proj.weight' was written twice"):
        engine.load_weights(named + [n for n in named if n[0] == "model.layers.0.self_attn.k_proj.weight"])
    assert engine.policy_version == 0


def test_an_unknown_name_and_a_wrong_shape_are_refused(tiny_llama, engine):
    from rlspec.rollout.errors import UnknownWeightError, WeightSyncError

    with pytest.raises(UnknownWeightError, match="'model.layers.0.mlp.experts.weight' has no place"):
        engine.load_weights(_named(tiny_llama) + [("model.layers.0.mlp.experts.weight", torch.zeros(2))])
    named = [(n, t[:1] if n == "model.norm.weight" else t) for n, t in _named(tiny_llama)]
    with pytest.raises(WeightSyncError, match=r"'model.norm.weight' has shape \(1,\), the runtime expects \(64,\)"):
        engine.load_weights(named)  # copy_ would have broadcast the one value over the whole norm
    assert engine.policy_version == 0


def test_a_sync_in_buckets_is_checked_as_one(tiny_llama, char_tokenizer, engine):
    """complete=False on all but the last call: one version bump for the whole sync; a missed bucket or a
    bucket sent twice is caught at the end / at once, and a failed sync leaves the next one a clean slate."""
    from rlspec.rollout.errors import WeightSyncError

    _perturb(tiny_llama)
    named = _named(tiny_llama)
    buckets = [named[i:i + 5] for i in range(0, len(named), 5)]
    for b in buckets[:-1]:
        engine.load_weights(b, complete=False)
        assert engine.policy_version == 0
    engine.load_weights(buckets[-1])
    assert engine.policy_version == 1
    fresh = RolloutEngine.from_hf_model(tiny_llama, char_tokenizer, max_model_len=64, max_num_seqs=4)
    prompt = char_tokenizer("What is 3 + 4?")["input_ids"]
    assert _greedy(engine, prompt) == _greedy(fresh, prompt)

    for b in buckets[:-2]:  # the second-to-last bucket never comes
        engine.load_weights(b, complete=False)
    with pytest.raises(WeightSyncError, match="never written"):
        engine.load_weights(buckets[-1])
    engine.load_weights(buckets[0], complete=False)
    with pytest.raises(WeightSyncError, match="written twice"):
        engine.load_weights(buckets[0], complete=False)
    for b in buckets:  # after the failures, a whole sync goes through again
        engine.load_weights(b, complete=False)
    engine.load_weights([])  # an empty closing call ends the sync
    assert engine.policy_version == 2
