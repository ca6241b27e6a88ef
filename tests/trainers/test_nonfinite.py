"""The trainers' on_nonfinite policy (trainers/run/checkpoint.py): NaN/inf logits during a rollout either stop the
run with a checkpoint of the state before the failing step (stop) or skip that step's batch (skip_batch).

Two ways in: a real NaN written into one MLP weight of the tiny policy before step 2 (the engine finds the
logits non-finite after the weight sync), and the engine's generate raising NonFiniteLogitsError on its
second call (the same error, weights untouched)."""
from __future__ import annotations

import math

import pytest
import torch
import trl
from transformers import TrainerCallback

from rlspec.rollout.errors import NonFiniteLogitsError
from rlspec.trainers.run import checkpoint_dirs as dirs
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.ppo.trainer import PPOTrainer
from rlspec.trainers.ppo.config import PPOConfig


def spread(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def _grpo(model, tokenizer, tmp_path, on_nonfinite: str, save_steps: int, max_steps: int = 3):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=8, max_steps=max_steps, logging_steps=1,
                          learning_rate=1e-2, report_to=[], save_steps=save_steps, disable_tqdm=True)
    return SpecGRPOTrainer(model=model, reward_funcs=[spread], args=args, train_dataset=make_math_dataset(16, seed=0),
                           processing_class=tokenizer, engine_kwargs=dict(max_model_len=256, max_num_seqs=8),
                           on_nonfinite=on_nonfinite)


class NanWeightAt(TrainerCallback):
    """Write NaN into one MLP weight of the policy when step `step` begins (the engine gets it at the sync)."""

    def __init__(self, model, step: int):
        self.model, self.step = model, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                self.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")


def _fail_generate_on_call(trainer, call: int) -> list:
    """Make the engine's generate raise NonFiniteLogitsError on its `call`-th call; returns the call log."""
    real, calls = trainer.engine.generate, []

    def generate(prompts, params=None, **kw):
        calls.append(1)
        if len(calls) == call:
            raise NonFiniteLogitsError("injected", step=3, rows=[1, 5], first_bad="model.layers.0.mlp")
        return real(prompts, params, **kw)

    trainer.engine.generate = generate
    return calls


def test_stop_on_a_nan_weight_names_the_step_and_keeps_the_last_good_checkpoint(tiny_llama, char_tokenizer, tmp_path):
    trainer = _grpo(tiny_llama, char_tokenizer, tmp_path, "stop", save_steps=1)
    trainer.add_callback(NanWeightAt(tiny_llama, 2))
    with pytest.raises(NonFiniteLogitsError, match="step 2") as err:
        trainer.train()
    out = tmp_path / "out"
    assert err.value.train_step == 2 and "on_nonfinite=stop" in str(err.value)
    assert "already non-finite" in str(err.value) and "down_proj" in str(err.value)  # not saved over good ones
    assert dirs.is_complete(out / "checkpoint-1") and not (out / "checkpoint-2").exists()
    assert trainer.state.global_step == 1


def test_stop_writes_the_state_before_the_failing_step(tiny_llama, char_tokenizer, tmp_path):
    """No checkpoint due yet (save_steps 100): the stop path writes checkpoint-1, the weights after step 1, with
    the rollout counter before the failing call; no update of step 2 was applied."""
    trainer = _grpo(tiny_llama, char_tokenizer, tmp_path, "stop", save_steps=100)
    _fail_generate_on_call(trainer, 2)
    with pytest.raises(NonFiniteLogitsError) as err:
        trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    assert err.value.train_step == 2 and err.value.checkpoint == str(ckpt) and str(ckpt) in str(err.value)
    assert "rows [1, 5]" in str(err.value) and "model.layers.0.mlp" in str(err.value)
    assert dirs.is_complete(ckpt)
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(saved[n], p.detach()) for n, p in tiny_llama.named_parameters() if n in saved)
    state = torch.load(ckpt / dirs.STATE_FILE, weights_only=True)
    assert state["rollout_calls"] == 1 and state["global_step"] == 1


def test_skip_batch_skips_the_step_without_an_update_and_goes_on(tiny_llama, char_tokenizer, tmp_path):
    trainer = _grpo(tiny_llama, char_tokenizer, tmp_path, "skip_batch", save_steps=100, max_steps=3)
    _fail_generate_on_call(trainer, 2)
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = {n: p.detach().clone() for n, p in tiny_llama.named_parameters()}

    trainer.add_callback(Snapshot())
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.nonfinite_skipped == 1
    same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    assert same(snapshots[1], snapshots[2]) and not same(snapshots[2], snapshots[3])
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert logged[2]["rollout/nonfinite_skipped"] == 1.0 and "reward" in logged[3]


def test_skip_batch_with_a_real_nan_weight_keeps_training(tiny_llama, char_tokenizer, tmp_path):
    """A NaN weight makes every rollout fail: each step is skipped, none applies an update."""
    trainer = _grpo(tiny_llama, char_tokenizer, tmp_path, "skip_batch", save_steps=100, max_steps=3)
    trainer.add_callback(NanWeightAt(tiny_llama, 2))
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.nonfinite_skipped == 2
    assert math.isnan(float(tiny_llama.model.layers[0].mlp.down_proj.weight[0, 0]))


def test_ppo_takes_the_same_policy(tiny_llama, char_tokenizer, tmp_path):
    args = PPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, seed=0, per_device_train_batch_size=4,
                     num_mini_batches=2, num_generations=4, num_ppo_epochs=1, max_completion_length=8, max_steps=2,
                     learning_rate=1e-3, kl_coef=0.0, report_to=[], save_steps=100, disable_tqdm=True)
    trainer = PPOTrainer(tiny_llama, [spread], args=args, train_dataset=make_math_dataset(16, seed=0),
                         processing_class=char_tokenizer, engine_kwargs=dict(max_model_len=256, max_num_seqs=8),
                         on_nonfinite="stop")
    _fail_generate_on_call(trainer, 2)
    with pytest.raises(NonFiniteLogitsError, match="step 2"):
        trainer.train()
    assert dirs.is_complete(tmp_path / "out" / "checkpoint-1")
    with pytest.raises(ValueError, match="on_nonfinite"):
        PPOTrainer(tiny_llama, [spread], args=args, on_nonfinite="ignore")
