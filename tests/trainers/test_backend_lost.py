"""A rollout backend lost mid-run (a Ray head gone, every worker dead: RolloutBackendLost) stops the trainer
with a checkpoint of the last finished step, so `resume=auto` continues once the cluster is back. The Ray side
(the pool raising RolloutBackendLost when its head dies) is tests/rollout/workers/test_faults.py; here the
engine's generate raises it on its second call, and the resumed trainer must end where a straight run ends."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.errors import RolloutBackendLost
from tests.trainers.conftest import build_tiny_llama
from tests.trainers.test_nonfinite import _grpo
from rlspec.trainers.run import checkpoint_dirs as dirs


def _lose_backend_on_call(trainer, call: int) -> None:
    real, calls = trainer.engine.generate, []

    def generate(prompts, params=None, **kw):
        calls.append(1)
        if len(calls) == call:
            raise RolloutBackendLost("injected: the Ray cluster's head at 127.0.0.1 does not answer")
        return real(prompts, params, **kw)

    trainer.engine.generate = generate


def _fresh_model(tokenizer):
    return build_tiny_llama(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_backend_lost_checkpoints_the_last_step_and_resume_matches_a_straight_run(char_tokenizer, tmp_path):
    lost = _grpo(_fresh_model(char_tokenizer), char_tokenizer, tmp_path / "lost", "stop", save_steps=100)
    _lose_backend_on_call(lost, 2)
    with pytest.raises(RolloutBackendLost) as err:
        lost.train()
    ckpt = tmp_path / "lost" / "out" / "checkpoint-1"
    assert "step 2" in str(err.value) and "resume=auto" in str(err.value) and str(ckpt) in str(err.value)
    assert dirs.is_complete(ckpt) and lost.state.global_step == 1
    lost.engine.close()

    resumed = _grpo(_fresh_model(char_tokenizer), char_tokenizer, tmp_path / "lost", "stop", save_steps=100)
    resumed.train(resume_from_checkpoint=True)
    resumed.engine.close()
    straight = _grpo(_fresh_model(char_tokenizer), char_tokenizer, tmp_path / "straight", "stop", save_steps=100)
    straight.train()
    straight.engine.close()
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), name
    rewards = lambda t: {h["step"]: h["reward"] for h in t.state.log_history if "reward" in h}  # noqa: E731
    assert rewards(straight)[2] == rewards(resumed)[2] and rewards(straight)[3] == rewards(resumed)[3]
    first = {n: p for n, p in _fresh_model(char_tokenizer).named_parameters()}
    moved = any(not torch.allclose(first[n], p) for n, p in straight.model.named_parameters())
    assert moved, "the policy must move for the comparison to mean anything"
