"""The learned drafter's chains looked ahead on CUDA (rollout/chains_ahead.py, Eagle3Drafter.propose_ahead; on by
default there): with its level and catch-up graphs replayed, greedy and keyed rollouts, drafts and acceptance equal
the step-by-step loop's."""
import pytest
import torch

from tests.rollout.speculation.test_eagle3_ahead import assert_same_rollouts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("keyed", [False, True], ids=["greedy", "keyed-T1"])
def test_cuda_chains_looked_ahead_give_the_step_by_step_rollouts(keyed, monkeypatch):
    from tests.rollout.speculation.test_eagle3_ahead import train_drafter

    hf, state = train_drafter()  # on the CPU (~2 s); the rollouts run on CUDA
    assert_same_rollouts(hf, state, "cuda", keyed, monkeypatch)
