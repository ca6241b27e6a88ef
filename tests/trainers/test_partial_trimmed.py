"""A partial batch through SpecGRPOTrainer's trimmed passes (trainers/trimmed_logps.py) in bf16, with
mask_truncated_completions and top_entropy_quantile: TRL's loss and its gradients as TRL's padded pass gives them,
within bf16 rounding; a chunk one token short (the planted flaw) is caught."""
from __future__ import annotations

import builtins
import functools

import pytest
import torch
import trl

from rlspec.trainers import partial_trl
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from tests.trainers.test_partial_rollouts import CAP, N, PARTIAL, distinct_chars_reward, eos_prone_llama


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from tests.trainers.conftest import build_char_tokenizer

    tok = build_char_tokenizer()
    args = trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("run")), use_cpu=True, bf16=False, seed=0,
                          num_generations=N, max_completion_length=CAP, max_steps=2, per_device_train_batch_size=8,
                          report_to=[], mask_truncated_completions=True, top_entropy_quantile=0.5)
    trainer = SpecGRPOTrainer(model=eos_prone_llama(tok).to(torch.bfloat16), reward_funcs=[distinct_chars_reward],
                              args=args, train_dataset=make_math_dataset(16, seed=0), processing_class=tok,
                              engine_kwargs=dict(max_model_len=256, compile_mode="off"),  # no C++ of steps here
                              partial_rollouts=PARTIAL)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a step
    replica = partial_trl.TrlGroups(trainer)
    inputs = trainer._generate_and_score_completions(replica() + replica())
    lengths = inputs["completion_mask"].sum(1)
    assert lengths.min() < inputs["completion_mask"].shape[1] / 2, "no padding to trim"
    return trainer, inputs


def loss_and_grads(trainer, inputs, padded: bool):
    model = trainer.model
    model.zero_grad()
    if padded:
        parent = functools.partial(trl.GRPOTrainer._get_per_token_logps_and_entropies, trainer)  # TRL's padded pass
        trainer._get_per_token_logps_and_entropies = parent
    try:
        loss = trainer._compute_loss(model, inputs)
    finally:
        trainer.__dict__.pop("_get_per_token_logps_and_entropies", None)
    loss.backward()
    return loss.detach().float(), torch.cat([p.grad.float().flatten() for p in model.parameters()
                                             if p.grad is not None])


@pytest.mark.parametrize("cut", [0, 1])
def test_a_partial_batch_trains_alike_through_the_trimmed_and_the_padded_pass_in_bf16(scored, cut, monkeypatch):
    """Per token, the log-probabilities and entropies at every real token agree within bf16 rounding; the loss
    (entropy mask, truncated completions masked, the partial token weights) and its gradients agree too."""
    import rlspec.trainers.trimmed_logps as tl

    trainer, inputs = scored
    model = trainer.model
    assert model.dtype == torch.bfloat16 and "partial_weight" in inputs
    want_loss, want = loss_and_grads(trainer, inputs, padded=True)
    if cut:  # each chunk's longest completion one token short
        monkeypatch.setattr(tl, "max", lambda *a, **k: builtins.max(*a, **k) - 1, raising=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    width, real = inputs["completion_ids"].shape[1], inputs["completion_mask"].bool()
    with torch.no_grad():
        parent = functools.partial(trl.GRPOTrainer._get_per_token_logps_and_entropies, trainer)  # TRL's padded pass
        lp, ent, _ = parent(model, ids, mask, width, compute_entropy=True)
        got_lp, got_ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, width, compute_entropy=True)
    worst = max(float((got_lp - lp)[real].abs().max()), float((got_ent - ent)[real].abs().max()))
    assert (worst < 0.05) != bool(cut), worst
    if cut:
        return
    loss, got = loss_and_grads(trainer, inputs, padded=False)
    assert float((got - want).norm() / want.norm()) < 0.02
    assert abs(float(loss - want_loss)) <= 0.02 * abs(float(want_loss)) + 1e-3
