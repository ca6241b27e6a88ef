"""rlspec.trainers.rloo: SpecRLOOTrainer end to end on a tiny random Llama (CPU, float32).

The end-to-end test is the losslessness check for RLOO, which logs no sampling-logprob difference of its own: in
float32 the trainer's own logprob of every sample (TRL's `old_logps`, summed over the completion, in TRL's row
order) equals the sum of the engine's sampling logprobs of the same tokens, at both steps (the second after an
optimizer update: the weight sync and the output order).
"""
from __future__ import annotations

import pytest
import torch
import trl

from tests.trainers.conftest import assert_two_steps_synced_once
from rlspec.rollout.types import SpecConfig
from rlspec.trainers import trl_compat
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.rloo import SpecRLOOTrainer


def distinct_chars_reward(completions, **kwargs):
    """A reward a random model's samples differ on, so advantages and the update are nonzero."""
    return [float(len(set(c[0]["content"]))) for c in completions]


def _args(tmp_path, **kw):
    return trl.RLOOConfig(**{**dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                                    per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                                    max_steps=2, logging_steps=1, learning_rate=1e-2, report_to=[],
                                    save_strategy="no", disable_tqdm=True, beta=0.0), **kw})


def test_two_rloo_steps_sample_the_policy_losslessly(tiny_llama, char_tokenizer, tmp_path):
    initial = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    trainer = SpecRLOOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=_args(tmp_path),
                              train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                              engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    sampled, scored = [], []
    engine_completions, score = trainer._engine_completions, trainer._generate_and_score_completions

    def record_samples(*a, **kw):
        completions, logprobs = engine_completions(*a, **kw)
        sampled.append(torch.tensor([sum(lp) for lp in logprobs]))
        return completions, logprobs

    def record_scores(inputs):
        out = score(inputs)
        scored.append(out["old_logps"].detach())
        return out

    trainer._engine_completions, trainer._generate_and_score_completions = record_samples, record_scores
    trainer.train()
    steps = assert_two_steps_synced_once(trainer, tiny_llama, initial)
    assert len(sampled) == len(scored) == 2
    for engine_sum, trl_sum in zip(sampled, scored):
        torch.testing.assert_close(trl_sum, engine_sum.to(trl_sum.dtype), atol=1e-4, rtol=1e-5)
    assert all(s[trl_compat.ENGINE_METRIC] == 1.0 for s in steps)
    assert not trainer.use_vllm  # RLOO has no importance-sampling correction to turn on


def test_refuses_lossy_modes_and_partial_rollouts(tmp_path):
    lossy = SpecConfig(drafter="ngram", verification="judge", accept_off_policy=True)
    with pytest.raises(ValueError, match="no importance-sampling correction"):
        SpecRLOOTrainer(model="unused", reward_funcs=[distinct_chars_reward], args=_args(tmp_path), spec_config=lossy)
    with pytest.raises(ValueError, match="partial rollouts"):
        SpecRLOOTrainer(model="unused", reward_funcs=[distinct_chars_reward], args=_args(tmp_path),
                        partial_rollouts={"oversample": 1.0})
    with pytest.raises(ValueError, match="use_vllm=False"):
        SpecRLOOTrainer(model="unused", reward_funcs=[distinct_chars_reward], args=_args(tmp_path, use_vllm=True))


def test_beam_search_goes_to_trl_generation_after_one_warning(tiny_llama, char_tokenizer, tmp_path):
    args = _args(tmp_path, generation_kwargs={"num_beams": 2})
    with pytest.warns(UserWarning, match="SpecRLOOTrainer: .*'num_beams'.* TRL's own generation") as caught:
        trainer = SpecRLOOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                                  train_dataset=make_math_dataset(8, seed=0), processing_class=char_tokenizer)
    assert sum("TRL's own generation" in str(w.message) for w in caught) == 1
    assert trainer.rollouts is None and trainer.engine is None
    prompt = char_tokenizer("1+1=")["input_ids"]
    completions = trainer._generate_single_turn([prompt, prompt], None, {})  # TRL's beam search, as plain TRL
    assert len(completions) == 2 and trainer._metrics["train"][trl_compat.ENGINE_METRIC] == [0.0]
