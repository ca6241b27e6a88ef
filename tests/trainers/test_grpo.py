"""rlspec.trainers.grpo: SpecGRPOTrainer end to end on a tiny random Llama (CPU, float32, W&B offline).

The end-to-end test is the losslessness check: TRL recomputes the policy's logprobs of every token
our engine sampled and logs the difference; in float32 it must be ~0 at every step, including the
step after an optimizer update (which also proves the weight sync and the output order).
"""
from __future__ import annotations

import pytest
import trl

from tests.trainers.conftest import assert_two_steps_synced_once
from tests.trainers.wandb_log import offline_run_files, read_history
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer, dedupe_repeated_prompts
from rlspec.trainers.rewards import get_reward_funcs


def distinct_chars_reward(completions, **kwargs):
    """A reward a random model's samples differ on, so advantages and the update are nonzero."""
    return [float(len(set(c[0]["content"]))) for c in completions]


def test_dedupe_keeps_trl_order():
    a, b = [1, 2], [3]
    assert dedupe_repeated_prompts([a, a, b, b], 2) == ([a, b], 2)
    assert dedupe_repeated_prompts([a, a, a, a], 2) == ([a, a], 2)  # the same prompt drawn twice
    # A process holding part of a group (multi-GPU) or mixed blocks: one sample per entry.
    assert dedupe_repeated_prompts([a, a, b], 2) == ([a, a, b], 1)
    assert dedupe_repeated_prompts([a, b, a, b], 2) == ([a, b, a, b], 1)
    assert dedupe_repeated_prompts([a, b], 1) == ([a, b], 1)


def test_refuses_vllm(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, report_to=[])
    with pytest.raises(ValueError, match="use_vllm=False"):
        SpecGRPOTrainer(model="unused", reward_funcs=[distinct_chars_reward], args=args)


def test_two_grpo_steps_are_lossless_and_logged_to_wandb(tiny_llama, char_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "rlspec-tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=8, num_generations=4,  # two prompts x four samples per step
        max_completion_length=8, max_steps=2, logging_steps=1, learning_rate=1e-2,
        report_to=["wandb"], save_strategy="no", disable_tqdm=True,
    )
    initial = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    trainer = SpecGRPOTrainer(
        model=tiny_llama, reward_funcs=[distinct_chars_reward, *get_reward_funcs(["accuracy"])], args=args,
        train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
        engine_kwargs=dict(max_model_len=256, max_num_seqs=8),
    )
    try:
        trainer.train()
    finally:
        import wandb

        if wandb.run is not None:
            wandb.finish()

    steps = assert_two_steps_synced_once(trainer, tiny_llama, initial)
    for log in steps:
        # Our logprobs equal the trainer's recomputed ones (float32): the rollouts are on-policy.
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert log["rollout/tokens_per_s"] > 0 and log["rollout/num_sequences"] == 8
    assert steps[1]["rollout/policy_version"] == 1.0

    runs = offline_run_files(str(tmp_path))
    assert len(runs) == 1, f"expected one offline W&B run under {tmp_path}"
    logged = set().union(*read_history(runs[0]))
    for key in ("train/rollout/tokens_per_s", "train/rollout/wall_s", "train/reward",
                "train/sampling/importance_sampling_ratio/mean", "train/sampling/sampling_logp_difference/max"):
        assert key in logged, f"{key} missing from the W&B history"

    rows = trainer.summary_callback.rows
    assert [row["step"] for row in rows] == [1, 2]
    assert all(0 < row["rollout_share"] <= 1 for row in rows)


def test_speculation_on_keeps_trl_importance_ratio_at_one(tiny_llama, char_tokenizer, tmp_path):
    """Issue 3's end-to-end check: with every decode step speculating (k=4 drafts of random tokens,
    so rejections and residual resampling happen all the time), TRL's recomputed logprobs still
    equal ours, so its importance ratio stays 1 as with speculation off."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SpecConfig
    from tests.rollout.spec_helpers import ScriptedDrafter

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1, learning_rate=1e-2,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )
    from rlspec.rollout.runtime.model import loader

    engine = RolloutEngine(loader.from_hf_model(tiny_llama), char_tokenizer, spec=SpecConfig(drafter="ngram"),
                           max_model_len=256, max_num_seqs=8, eos_token_ids=[char_tokenizer.eos_token_id],
                           drafter=ScriptedDrafter(tiny_llama.config.vocab_size, corrupt=1.0))
    engine.speculation.force(Arm("scripted", 4, 1))  # speculate at every step
    trainer = SpecGRPOTrainer(
        model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
        train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer, engine=engine,
    )
    trainer.train()
    steps = [log for log in trainer.state.log_history if "reward" in log]
    assert len(steps) == 2
    for log in steps:
        assert log["rollout/spec_step_share"] > 0.5
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert abs(log["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
