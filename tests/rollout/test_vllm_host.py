"""The vLLM backend's pieces that need no vLLM: the depth table from step costs, and the drafter host
(the learned drafter, its trainer and warm start, without a copy of the policy). Main environment."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.types import SpecConfig
from rlspec.rollout.vllm_backend import depth
from rlspec.rollout.vllm_backend.host import DrafterHost
from tests.conftest import make_tiny_hf, random_prompts


def linear_cost(batch: int, T: int) -> float:
    """A forward costs a fixed launch plus its tokens: verifying is nearly free at batch 1, dear at 64."""
    return 1.0 + batch * T / 16


def test_depth_table_from_costs_deepens_as_the_batch_shrinks():
    table = depth.depth_table_from_costs(linear_cost, acceptance=0.8, max_depth=4, max_batch=64)
    assert table.ranges[0][0] == 1 and table.ranges[-1][1] == 64
    per_batch = [table.depth(b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert per_batch == sorted(per_batch, reverse=True) and per_batch[0] == 4 and per_batch[-1] == 0
    # batch 8: rel(d) = (1 + 8 (1 + d) / 16) / 1.5; E = sum 0.8^i: d=1 1.8/1.33=1.35, d=2 2.44/1.67=1.46,
    # d=4 3.36/2.33=1.44 -> 2
    assert table.depth(8) == 2


def test_no_speculation_where_it_cannot_pay():
    assert depth.depth_table_from_costs(linear_cost, acceptance=0.0, max_depth=4, max_batch=8).max_depth == 0
    capped = depth.depth_table_from_costs(linear_cost, acceptance=0.8, max_depth=4, max_batch=8, max_spec_batch=2)
    assert capped.depth(1) == 4 and capped.depth(4) == 0


def host_for(policy, **spec):
    return DrafterHost.build(policy, SpecConfig(drafter="eagle3", num_draft_tokens=3, **spec))


def test_host_holds_the_drafter_and_no_copy_of_the_policy():
    policy = make_tiny_hf("llama")
    host = host_for(policy, online_training=True, online_trainer="thread")
    try:
        target = host.drafter.target
        assert not any("layers" in n for n, _ in target.named_parameters())  # no decoder layer at all
        theirs = {p.data_ptr() for p in policy.parameters()}
        assert all(p.data_ptr() in theirs for p in target.parameters())  # embedding, norm, head: shared, not copied
        intake = host.intake()
        assert intake.aux_layers == host.drafter.aux_layers and intake.topk == host.trainer.topk
        assert host.version() == 0 and len(host.drafter_tensors()) > 0
    finally:
        host.close()
    assert DrafterHost.build(policy, SpecConfig(drafter="ngram")) is None
    assert host_for(policy, online_training=False).intake() is None  # nothing would read the samples


@pytest.mark.parametrize("online", [False, True])
def test_warm_start_samples_elsewhere_and_feeds_one_pass_of_the_policy(online, tmp_path):
    """The warm start's sampler is any generate() (vLLM's in the backend; a plain engine here): the drafter
    trains on features of the policy's own pass over those samples, then a cached second call loads it."""
    policy = make_tiny_hf("llama", seed=4)
    sampler = RolloutEngine.from_hf_model(policy, None, max_model_len=128, max_num_seqs=8)
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts) * params.n)
        return sampler.generate(prompts, params)

    host = host_for(policy, online_training=online, online_trainer="thread")
    if online:
        host.trainer.min_tokens = 64
    try:
        before = [t.clone() for _, t in host.drafter_tensors()]
        prompts = random_prompts(4, 4, 10, seed=4)
        result = host.warm_start(generate, policy, prompts, budget_s=120.0, max_steps=10, group=2, max_new_tokens=16,
                                 temperature=1.0, steps_per_round=5, root=tmp_path, use_tqdm=False, min_tokens=64)
        assert len(calls) == 2 and not result.cached and result.steps == 10 and result.tokens > 0
        assert host.version() >= 1
        assert any(not torch.equal(a, b) for a, (_, b) in zip(before, host.drafter_tensors()))
        if online:  # the online trainer kept the warm-up's data and goes on from it
            assert host.trainer.buffer.tokens == result.tokens
        again = host_for(policy, online_training=online, online_trainer="thread")
        try:
            cached = again.warm_start(generate, policy, prompts, budget_s=3.0, group=2, max_new_tokens=16,
                                      temperature=1.0, root=tmp_path, use_tqdm=False)
            assert cached.cached and again.version() >= 1
            for (_, a), (_, b) in zip(host.drafter_tensors(), again.drafter_tensors()):
                torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)  # the cache stores the export (bf16)
        finally:
            again.close()
    finally:
        host.close()


class FakeHost:
    """A drafter host whose published version the test moves by hand."""

    def __init__(self):
        self.v = 0

    def version(self):
        return self.v

    def drafter_tensors(self):
        return [("w", torch.full((2,), float(self.v)))]


@pytest.mark.parametrize("every", [1, 3])
def test_push_drafter_pushes_at_most_once_per_call_and_every_n_versions(monkeypatch, every):
    from rlspec.rollout.vllm_backend import backend as vb

    pushed = []
    monkeypatch.setattr(vb.weights, "load_drafter", lambda llm, tensors: pushed.append(float(tensors[0][1][0])))
    backend = object.__new__(vb.VLLMBackend)  # no vLLM: only the push bookkeeping runs
    backend.llm, backend.host, backend.drafter_push_every = None, FakeHost(), every
    backend._pushed_drafter, backend._drafter_pushes, backend.depth_table = 0, 0, None
    assert not backend.push_drafter()  # nothing new
    backend.host.v = 2
    assert backend.push_drafter() == (every <= 2) and backend.push_drafter() is False  # one push per call at most
    backend.host.v = 5
    assert backend.push_drafter()
    assert pushed == ([2.0, 5.0] if every == 1 else [5.0]) and backend._drafter_pushes == len(pushed)
    backend.host.v = 6
    assert backend.push_drafter(force=True) and pushed[-1] == 6.0  # a warm start's result goes in at once
