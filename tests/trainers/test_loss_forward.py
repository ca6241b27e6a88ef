"""trainers/loss_forward.py: the first no-grad pass over a generation batch runs as the loss's forward.

End to end (tiny random Llama, float32, CPU): SpecRLOOTrainer (KL penalty on, so a reference pass runs between the
two) and SpecGRPOTrainer (its importance-sampling correction needs the first pass) train to the same weights with
the reuse as without it, while the policy runs one pass a step instead of two; TRL shuffles the rows in between, so
the loss's rows are matched back. Where the two passes may differ (dropout, more than one loss per generation batch)
both passes run, as in TRL.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import trl

from rlspec.trainers import loss_forward
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.rloo import SpecRLOOTrainer
from tests.trainers.conftest import build_tiny_llama


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def _train(cls, config_cls, char_tokenizer, tmp_path, reuse: bool, monkeypatch, **config):
    """Two steps from the same weights and seed; -> (final parameters, policy passes per step, each through the
    trimmed pass: the one pass that serves both skips the padding too)."""
    path = tmp_path / "tiny"  # a saved model: TRL loads the reference model (beta > 0) from its path
    if not path.exists():
        build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id
                         ).save_pretrained(path)
    args = config_cls(**{**dict(output_dir=str(tmp_path / f"out{reuse}"), use_cpu=True, bf16=False, seed=0,
                                per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                                max_steps=2, logging_steps=1, learning_rate=1.0, optim="sgd", report_to=[],
                                save_strategy="no", disable_tqdm=True), **config})
    if not reuse:
        monkeypatch.setattr(loss_forward, "reusable", lambda trainer, kwargs: False)
    trainer = cls(model=str(path), reward_funcs=[distinct_chars_reward], args=args,
                  train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                  engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    model, passes, trimmed = trainer.model, [], trainer._trimmed_logps
    assert next(model.parameters()).dtype == torch.float32

    def counted(m, *a, **kw):
        if m is model:
            passes.append(torch.is_grad_enabled())
        return trimmed(m, *a, **kw)

    trainer._trimmed_logps = counted
    trainer.train()
    monkeypatch.undo()
    assert trainer._loss_forward is None  # never outlives its step
    return {n: p.detach().clone() for n, p in model.named_parameters()}, len(passes) / 2


@pytest.mark.parametrize("cls,config_cls,config", [
    (SpecRLOOTrainer, trl.RLOOConfig, dict(beta=0.05)),  # TRL's default: gradient checkpointing on
    (SpecGRPOTrainer, trl.GRPOConfig, dict(beta=0.0, gradient_checkpointing=False)),
], ids=["rloo", "grpo-no-checkpointing"])
def test_one_policy_pass_a_step_and_the_same_weights(cls, config_cls, config, char_tokenizer, tmp_path, monkeypatch):
    reused, one_pass = _train(cls, config_cls, char_tokenizer, tmp_path, True, monkeypatch, **config)
    separate, two_passes = _train(cls, config_cls, char_tokenizer, tmp_path, False, monkeypatch, **config)
    assert (one_pass, two_passes) == (1, 2)
    initial = dict(build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id,
                                    char_tokenizer.pad_token_id).named_parameters())
    # SGD keeps a rounding difference at its size (Adam's first steps move every weight by about lr, whatever
    # its gradient): the updates are 1e-4..1e-1, rows paired with the wrong samples would be off by as much
    assert max((p - initial[name]).abs().max().item() for name, p in reused.items()) > 1e-2
    for name, p in reused.items():
        torch.testing.assert_close(p, separate[name], rtol=0, atol=1e-6, msg=name)


def test_two_losses_per_generation_batch_keep_both_passes(char_tokenizer, tmp_path, monkeypatch):
    _, passes = _train(SpecRLOOTrainer, trl.RLOOConfig, char_tokenizer, tmp_path, True, monkeypatch, beta=0.0,
                       num_iterations=2)
    assert passes == 1.5  # one first pass and two losses, every other step (TRL's own passes)


def _trainer(**over):
    args = SimpleNamespace(steps_per_generation=1, use_liger_kernel=False)
    model = build_tiny_llama(16, 1, 0)
    model.train()
    base = dict(model=model, args=args, num_iterations=1, accelerator=SimpleNamespace(num_processes=1),
                is_deepspeed_enabled=False, is_fsdp_enabled=False, aux_loss_enabled=False)
    for key, value in over.items():
        if hasattr(args, key):
            setattr(args, key, value)
        else:
            base[key] = value
    return SimpleNamespace(**base)


@pytest.mark.parametrize("change", [
    dict(steps_per_generation=2), dict(num_iterations=2),
    dict(accelerator=SimpleNamespace(num_processes=2)), dict(is_deepspeed_enabled=True), dict(is_fsdp_enabled=True),
    dict(aux_loss_enabled=True), dict(use_liger_kernel=True),
], ids=lambda c: next(iter(c)))
def test_not_reusable_where_the_passes_could_differ(change):
    assert loss_forward.reusable(_trainer(), {"batch_size": 8, "num_images": None})
    assert not loss_forward.reusable(_trainer(**change), {"batch_size": 8})


def test_not_reusable_in_evaluation_with_dropout_or_extra_inputs():
    trainer = _trainer()
    assert not loss_forward.reusable(trainer, {"pixel_values": torch.zeros(1)})
    trainer.model.config.attention_dropout = 0.1
    assert not loss_forward.reusable(trainer, {})
    trainer = _trainer()
    trainer.model.model.layers[0].mlp.drop = torch.nn.Dropout(0.1)
    assert not loss_forward.reusable(trainer, {})
    trainer = _trainer()
    trainer.model.eval()
    assert not loss_forward.reusable(trainer, {})


def test_rows_match_back_through_a_shuffle_and_repeats():
    kept = [(1, 2), (3, 4), (1, 2), (5, 6)]
    order = loss_forward.match_rows(kept, [(5, 6), (1, 2), (3, 4), (1, 2)])
    assert sorted(order) == [0, 1, 2, 3] and [kept[i] for i in order] == [(5, 6), (1, 2), (3, 4), (1, 2)]
    assert loss_forward.match_rows(kept, [(5, 6), (1, 2), (3, 4), (3, 4)]) is None  # not the same rows
    ids, mask = torch.tensor([[7, 8, 9], [7, 8, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert loss_forward.row_keys(ids, mask) == [(7, 8, 9, 1, 1, 1), (7, 8, 0, 1, 1, 0)]
