"""Two GRPO steps with rollout.backend=vllm and the learned drafter on (tiny float32 Llama, CPU).

What reaches vLLM is checked by what comes out of it: a new drafter version changes vLLM's draft model,
and TRL's importance-sampling metrics (its own recomputation of every sampled token's logprob under the
current policy) stay at ratio 1 only if vLLM sampled from the weights of that step.
"""
from __future__ import annotations

import pytest
import torch
import trl
from transformers import TrainerCallback

from tests.vllm.conftest import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

from rlspec.rollout.types import SpecConfig
from rlspec.rollout.vllm_backend.backend import VLLMBackend
from tests.trainers.conftest import assert_two_steps_synced_once
from tests.vllm.conftest import build_tiny_llama64
from rlspec.trainers.data import make_math_dataset, prompt_token_ids
from rlspec.trainers.grpo import SpecGRPOTrainer


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def draft_weight_sum(backend: VLLMBackend) -> float:
    """A fingerprint of vLLM's draft model as vLLM holds it."""
    def fingerprint(worker):
        return float(sum(p.detach().double().abs().sum() for p in worker.model_runner.get_draft_model().parameters()))

    return backend.llm.collective_rpc(fingerprint)[0]


def test_two_grpo_steps_on_vllm_with_the_learned_drafter(char_tokenizer, tmp_path, monkeypatch):
    tiny_llama64 = build_tiny_llama64(char_tokenizer, layers=8)  # EAGLE-3 reads layers (2, 4, 5)
    monkeypatch.setenv("RLSPEC_CACHE", str(tmp_path / "cache"))  # the warm start caches its drafter here
    initial = {n: p.detach().clone() for n, p in tiny_llama64.named_parameters()}
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1, learning_rate=1e-2,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, selector="always", online_training=False,
                      draft_vocab_size=len(char_tokenizer))
    trainer = SpecGRPOTrainer(
        model=tiny_llama64, reward_funcs=[distinct_chars_reward], args=args,
        train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer, spec_config=spec,
        engine_kwargs={"backend": "vllm", "dtype": "float32", "max_model_len": 256},
    )
    backend = trainer.engine
    assert isinstance(backend, VLLMBackend) and backend.has_learned_drafter
    assert backend.speculative_config["method"] == "eagle3"

    # a new drafter version (a warm start on the policy's own rollouts) goes into vLLM's draft model
    cold = draft_weight_sum(backend)
    prompts = prompt_token_ids(char_tokenizer, trainer.train_dataset["prompt"][:4])
    # vLLM samples, one no-grad pass of the policy through the tap gives the features (the first vLLM call on a
    # CPU compiles for seconds: a step budget keeps the test's length independent of the machine)
    result = backend.warm_start_drafter(prompts, budget_s=300.0, group=2, max_new_tokens=16, temperature=1.0,
                                        max_steps=5, min_tokens=64, use_tqdm=False)
    assert result.steps == 5 and result.tokens > 0 and backend.host.version() > 0
    assert backend.stats()["vllm/drafter_pushes"] == 1.0
    assert draft_weight_sum(backend) != cold

    trainer.train()
    steps = assert_two_steps_synced_once(trainer, tiny_llama64, initial)  # policy weights went to vLLM once
    for log in steps:
        assert log["rollout/accept_len"] >= 1.0  # vLLM speculated with the drafter at every step
        assert log["sampling/sampling_logp_difference/max"] < 1e-3
        assert abs(log["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
    backend.close()


def test_grpo_on_vllm_trains_the_drafter_from_its_own_pass_and_pushes_versions(char_tokenizer, tmp_path):
    """Online drafter training on vLLM's rollouts: the trainer's old-logprob pass feeds the host's drafter
    trainer (no second policy anywhere), and each new version reaches vLLM before the next rollout."""
    policy = build_tiny_llama64(char_tokenizer, layers=8)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, max_steps=3, logging_steps=1, learning_rate=1e-2,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, selector="always", online_training=True,
                      online_trainer="thread", draft_vocab_size=len(char_tokenizer))

    class TrainOneStep(TrainerCallback):
        """One synchronous drafter step after each RL step: a new version every step, whatever the timing."""

        def on_step_end(self, *_, **__):
            backend.host.trainer.train_steps(1)

    trainer = SpecGRPOTrainer(
        model=policy, reward_funcs=[distinct_chars_reward], args=args, train_dataset=make_math_dataset(16, seed=0),
        processing_class=char_tokenizer, spec_config=spec, callbacks=[TrainOneStep()],
        engine_kwargs={"backend": "vllm", "dtype": "float32", "max_model_len": 256},
    )
    backend = trainer.engine
    host = backend.host
    # the host holds the drafter and a view of the policy's embedding, norm and head, shared, never a copy
    assert not any("layers" in n for n, _ in host.drafter.target.named_parameters())
    theirs = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() in theirs for p in host.drafter.target.parameters())
    dt = host.trainer
    dt.min_tokens, dt.publish_every = 32, 1
    cold = draft_weight_sum(backend)
    try:
        trainer.train()
        feed = trainer.rollouts.drafter_feed
        assert feed.claimed and feed.fed == 3 * 8  # every rollout vLLM sampled, once
        assert len(dt.buffer.segments) == 3 * 8 and {s[2] for s in dt.buffer.segments} == {0, 1, 2}
        steps = [log for log in trainer.state.log_history if "reward" in log]
        assert len(steps) == 3
        assert [log["vllm/drafter_pushes"] for log in steps] == [0.0, 1.0, 2.0]  # (cumulative) one per later rollout
        assert steps[1]["drafter/version"] >= 1 and steps[2]["drafter/version"] > steps[1]["drafter/version"]
        assert draft_weight_sum(backend) != cold
        for log in steps:
            assert log["sampling/sampling_logp_difference/max"] < 1e-3
        # logged right after each rollout: the pass that feeds a rollout's samples comes after its log line
        assert steps[0]["drafter/buffer_tokens"] == 0 < steps[1]["drafter/buffer_tokens"] < steps[2]["drafter/buffer_tokens"]
    finally:
        backend.close()
