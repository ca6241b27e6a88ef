"""rlspec.trainers.ppo.trainer: PPOTrainer end to end on a tiny random Llama (CPU, float32).

Two PPO steps run with metrics present and finite; the rollouts are on-policy (the trainer's
recomputed logprobs equal the engine's, so the importance ratio is 1 in float32); the value model is
saved with every checkpoint and a resumed run reloads it; bad settings fail with clear errors.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.trainers.conftest import assert_two_steps_synced_once
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.ppo.trainer import PPOTrainer
from rlspec.trainers.ppo.config import PPOConfig
from rlspec.trainers.ppo.model import VALUE_FILE


def distinct_chars_reward(completions, **kwargs):
    """A reward a random model's samples differ on, so advantages and the update are nonzero."""
    return [float(len(set(c[0]["content"]))) / 10 for c in completions]


def ppo_args(tmp_path, **overrides) -> PPOConfig:
    settings = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, report_to="none",
                    per_device_train_batch_size=4, num_mini_batches=2, num_generations=4, num_ppo_epochs=2,
                    max_completion_length=8, max_steps=2, learning_rate=1e-3, value_learning_rate=1e-2,
                    save_strategy="no", disable_tqdm=True, kl_coef=0.05)
    return PPOConfig(**{**settings, **overrides})


def make_trainer(model, tokenizer, args, **kwargs) -> PPOTrainer:
    return PPOTrainer(model=model, reward_funcs=[distinct_chars_reward], args=args,
                      train_dataset=make_math_dataset(16, seed=0), processing_class=tokenizer,
                      engine_kwargs=dict(max_model_len=256, max_num_seqs=8), **kwargs)


EXPECTED = ["reward", "loss/policy", "loss/value", "policy/approxkl", "policy/clipfrac", "val/clipfrac", "val/mean",
            "objective/kl", "objective/entropy", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/mean", "rollout/wall_s", "rollout/tokens_per_s", "step_time"]


@pytest.mark.parametrize("options", [
    dict(value_model="head"),
    dict(value_model="separate"),
    # KL in the loss (verl's use_kl_loss) with k3, whitened rewards, masked IS weights, EOS penalty
    dict(kl_in_reward=False, kl_estimator="k3", whiten_rewards=True, importance_sampling_mode="token_mask",
         missing_eos_penalty=1.0),
], ids=["head", "separate", "kl_in_loss"])
def test_two_ppo_steps_are_on_policy_and_logged(tiny_llama, char_tokenizer, tmp_path, options):
    initial = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    trainer = make_trainer(tiny_llama, char_tokenizer, ppo_args(tmp_path, **options))
    trainer.train()
    steps = assert_two_steps_synced_once(trainer, tiny_llama, initial)
    # num_ppo_epochs x num_mini_batches updates per step, and the Trainer's own step after each
    # training_step (all gradients None) adds none
    embed = tiny_llama.get_input_embeddings().weight
    assert int(trainer.optimizer.state[embed]["step"]) == 2 * 2 * 2
    for log in steps:
        for key in EXPECTED:
            assert key in log and math.isfinite(log[key]), key
        # float32 everywhere: the engine's logprobs are the policy's, so the rollouts are on-policy
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
        assert log["rollout/num_sequences"] == 8
    assert steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference at step 1
    assert [row["step"] for row in trainer.summary_callback.rows] == [1, 2]


def test_critic_warmup_leaves_the_policy_and_decoupled_gae_targets_the_outcome(tiny_llama, char_tokenizer, tmp_path):
    """value_warmup_steps=1: step 1 moves the value head only; step 2 moves the policy too. value_lam=1
    (gamma 1, no KL): every real token's value target is the completion's score (Monte Carlo), while
    the policy's advantages still use lam=0.95 (they are not score - V)."""
    args = ppo_args(tmp_path, value_warmup_steps=1, value_lam=1.0, lam=0.95, kl_coef=0.0, whiten_advantages=False)
    trainer = make_trainer(tiny_llama, char_tokenizer, args)
    snapshots, experiences = [], []
    experience = trainer._experience

    def spy(model, batch):
        snapshots.append(({n: p.detach().clone() for n, p in tiny_llama.named_parameters()},
                          trainer.model.value_head.weight.detach().clone()))
        experiences.append(experience(model, batch))
        return experiences[-1]

    trainer._experience = spy
    trainer.train()
    (before_1, head_1), (before_2, head_2) = snapshots
    assert all(torch.equal(before_1[n], before_2[n]) for n in before_1)  # warm-up: the policy did not move
    assert not torch.equal(head_1, head_2)  # ... the value head did
    after = dict(tiny_llama.named_parameters())
    assert any(not torch.equal(before_2[n], after[n]) for n in before_2)  # step 2 trains the policy
    exp = experiences[1]
    mask = exp.mask.bool()
    targets = exp.scores[:, None].expand_as(exp.returns)
    assert torch.allclose(exp.returns[mask], targets[mask], atol=1e-6)
    monte_carlo = (exp.scores[:, None] - exp.old_values)[mask]
    assert not torch.allclose(exp.advantages[mask], monte_carlo, atol=1e-3)  # lam 0.95 for the policy


def test_value_model_is_checkpointed_and_resume_restores_it(tiny_llama, char_tokenizer, tmp_path):
    args = ppo_args(tmp_path, save_strategy="steps", save_steps=1, max_steps=1, kl_coef=0.0)
    trainer = make_trainer(tiny_llama, char_tokenizer, args)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / VALUE_FILE).is_file() and (checkpoint / "model.safetensors").is_file()
    head = trainer.model.value_head.weight.detach().clone()
    assert head.abs().sum() > 0  # the zero-initialised head learned something

    from tests.trainers.conftest import build_tiny_llama

    fresh = build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id, seed=1)
    resumed = make_trainer(fresh, char_tokenizer, ppo_args(tmp_path, save_strategy="no", max_steps=2, kl_coef=0.0))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    # the first rollout after resuming ran on the checkpoint's weights, pushed into the engine
    assert resumed.weight_syncer.num_syncs == 1
    assert not torch.equal(resumed.model.value_head.weight, torch.zeros_like(head))


def test_final_model_is_a_plain_hf_directory(tiny_llama, char_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tiny_llama, char_tokenizer, ppo_args(tmp_path, max_steps=1, kl_coef=0.0))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for name, param in tiny_llama.named_parameters():
        assert torch.equal(loaded.state_dict()[name], param.detach()), name
    assert os.path.isfile(tmp_path / "final" / VALUE_FILE)


@pytest.mark.parametrize("overrides, message", [
    (dict(per_device_train_batch_size=3, num_mini_batches=1, num_generations=4), "multiple of num_generations"),
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=1"),
    (dict(kl_estimator="k2"), "kl_estimator"),
    (dict(value_model="tied"), "value_model"),
    (dict(cliprange=0.0), "cliprange"),
    (dict(importance_sampling_cap=0.5), "importance_sampling_cap"),
])
def test_bad_config_values_fail_clearly(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        ppo_args(tmp_path, **overrides)


def test_reward_models_by_name_are_refused(tiny_llama, char_tokenizer, tmp_path):
    with pytest.raises(TypeError, match="reward_funcs"):
        PPOTrainer(model=tiny_llama, reward_funcs="some/reward-model", args=ppo_args(tmp_path),
                   processing_class=char_tokenizer)
