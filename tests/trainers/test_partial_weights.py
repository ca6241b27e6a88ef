"""Token weights with partial rollouts (docs/partial_rollouts.md#token-weights): a partial batch trains the groups
that finished together, so TRL's dapo and bnpo normalisers (the batch's, the micro-batch's token count) would weigh
long samples less than with partial rollouts off; partial_trl divides by the normaliser the samples would have met
off instead. Measured on the pool over a simulated long-tail decoder (rlspec.bench.partial_weights): cap-length
samples' share of the loss weight within 2 points of off, and more than 2 points off without the correction."""
from __future__ import annotations

import types

import pytest
import torch

from rlspec.bench.partial_weights import shares
from rlspec.trainers import partial_trl
from rlspec.trainers.partial_rollouts import off_policy_normalisers


@pytest.fixture(scope="module")
def cells():
    return shares(cap=256, short_mean=40.0, groups=2, n=4, micro_rows=4, steps=12, seeds=range(12),
                  oversamples=[1.0, 4.0])


@pytest.mark.parametrize("loss", ["dapo", "bnpo", "grpo"])
@pytest.mark.parametrize("oversample", ["1", "4"])
def test_cap_length_samples_weigh_as_with_partial_rollouts_off(cells, loss, oversample):
    off = cells[("off", loss)]
    assert abs(cells[(f"on-{oversample}-corrected", loss)] - off) < 0.02, (off, cells)


def test_without_the_correction_finish_order_weighs_long_samples_less(cells):
    """The bias the correction removes (oversample 1: the rounds train what finished first)."""
    for loss in ("dapo", "bnpo"):
        assert cells[("on-1-uncorrected", loss)] < cells[("off", loss)] - 0.02, cells


def test_known_batch_mates_give_exactly_trls_normaliser():
    """Group 0 trains while its batch-mate in TRL's order (finished, or one sample of 5 tokens in flight where the
    run's finished samples that ran longer are 6 tokens) is known: dapo divides by the batch's tokens, as off."""
    population = [[(3, True), (5, True), (2, True)], [(6, True), (6, True), (1, True)]]
    assert off_policy_normalisers([[3, 5, 2]], [[population[1]]], population, None, cap=50) == \
        pytest.approx([1 / 23] * 3)
    pending = [(5, False), (6, True), (1, True)]
    assert off_policy_normalisers([[3, 5, 2]], [[pending]], population, None, cap=50) == pytest.approx([1 / 23] * 3)
    assert off_policy_normalisers([[3, 5, 2]], [[[(7, False)]]], population, None, cap=50) == \
        pytest.approx([1 / 60] * 3)  # none ran longer: the cap


def test_the_weights_replace_trls_normaliser_in_the_loss():
    """reweighted scales each row's advantage by weight x TRL's normaliser, so TRL's division leaves the weight."""
    trainer = types.SimpleNamespace(model=types.SimpleNamespace(training=True), loss_type="dapo",
                                    accelerator=types.SimpleNamespace(num_processes=1))
    inputs = {"advantages": torch.tensor([1.0, -2.0]), "partial_weight": torch.tensor([0.01, 0.02]),
              "num_items_in_batch": torch.tensor(50.0), "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    assert torch.allclose(partial_trl.reweighted(trainer, inputs)["advantages"], torch.tensor([0.5, -2.0]))
    trainer.loss_type = "bnpo"  # the micro-batch's 4 tokens
    assert torch.allclose(partial_trl.reweighted(trainer, inputs)["advantages"], torch.tensor([0.04, -0.16]))
    trainer.loss_type = "grpo"  # the others never get weights; none stored, nothing changes
    assert partial_trl.reweighted(trainer, {"advantages": inputs["advantages"]})["advantages"] is inputs["advantages"]
