"""A lossy mode under GRPO: the behaviour logprobs reach TRL, whose importance ratio moves away from 1
exactly on the tokens whose law the judge changed (the judge's, and exact-accepted tokens it would have
kept anyway: emitted with probability 1) and stays 1 on every other token."""
from __future__ import annotations

import math

import pytest
import trl

from tests.trainers.test_grpo import distinct_chars_reward
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer


def test_trl_importance_ratio_moves_exactly_on_lossy_tokens(tiny_llama, char_tokenizer, tmp_path):
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.lossy.judge import JUDGE, TARGET
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SpecConfig
    from tests.rollout.spec_helpers import ScriptedDrafter

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, max_steps=1, logging_steps=1, learning_rate=1e-2,
        report_to="none", save_strategy="no", disable_tqdm=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1e6,  # see every ratio
    )
    spec = SpecConfig(drafter="ngram", verification="judge", judge="prob", judge_threshold=0.005,
                      accept_off_policy=True)
    engine = RolloutEngine(loader.from_hf_model(tiny_llama), char_tokenizer, spec=spec, max_model_len=256,
                           max_num_seqs=8, eos_token_ids=[char_tokenizer.eos_token_id],
                           drafter=ScriptedDrafter(tiny_llama.config.vocab_size, corrupt=1.0))
    engine.speculation.force(Arm("scripted", 4, 1))
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                              train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                              engine=engine)
    results, outputs = [], []
    generate, score = trainer.rollouts.generate, trainer._generate_and_score_completions
    trainer.rollouts.generate = lambda *a, **k: results.extend(generate(*a, **k)) or results[-8:]
    trainer._generate_and_score_completions = lambda inputs: outputs.append(score(inputs)) or outputs[-1]
    trainer.train()

    ratio, mask = outputs[0]["importance_sampling_ratio"], outputs[0]["completion_mask"]
    assert len(results) == ratio.shape[0] == 8
    lossy_seen = 0
    for i, r in enumerate(results):
        assert mask[i].sum() == len(r.completion_ids)
        for t, (src, lp, blp) in enumerate(zip(r.token_source, r.logprobs, r.behaviour_logprobs)):
            # a deterministic draft the judge keeps is emitted with probability 1 (behaviour 0), even where the
            # exact test accepted it too; every other token's law is the target's (behaviour == logprob)
            assert blp == lp or (blp == 0.0 and src != TARGET)
            if blp != lp:  # TRL saw the behaviour logprob: its ratio is p(x) / 1 = exp(lp - blp) < 1
                lossy_seen += src == JUDGE
                assert abs(ratio[i, t].item() - 1) > 1e-3
                assert ratio[i, t].item() == pytest.approx(math.exp(lp - blp), rel=1e-3)
            else:
                assert src != JUDGE and abs(ratio[i, t].item() - 1) < 1e-3
    assert lossy_seen > 0
    log = next(entry for entry in trainer.state.log_history if "reward" in entry)
    assert log["rollout/lossy_token_share"] > 0 and log["sampling/importance_sampling_ratio/min"] < 0.999
