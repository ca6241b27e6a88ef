"""trainers/drafter_feed.py: GRPO's and PPO's own no-grad pass over their rollouts trains the EAGLE-3 drafter.

A short run with the learned drafter trained online (tiny random Llama, CPU, float32): every rollout
reaches the drafter's buffer exactly once, from the trainer's tap (the engine's own banking is off
once the trainer claims the intake), tagged with the policy version that sampled it, and the
trainer publishes drafter versions the engine then drafts with.
"""
from __future__ import annotations

import trl

from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.trainers.test_grpo import distinct_chars_reward
from rlspec.trainers.data import make_math_dataset, prompt_token_ids
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.ppo.trainer import PPOTrainer
from rlspec.trainers.ppo.config import PPOConfig

SPEC = SpecConfig(drafter="eagle3", num_draft_tokens=3, selector="always", online_training=True,
                  online_trainer="thread")


def fast_trainer(engine):
    """The engine's online DrafterTrainer, made to train and publish on a few hundred tokens."""
    dt = engine.speculation.trainer
    dt.min_tokens, dt.publish_every = 32, 1
    return dt


def check_fed(trainer, dt, rollouts: int, banked_before: int) -> None:
    feed, engine = trainer.rollouts.drafter_feed, trainer.engine
    assert feed is not None and feed.claimed and not engine.speculation.learned.bank_samples
    assert feed.fed == rollouts  # every rollout of the run, once
    assert len(dt.buffer.segments) == banked_before + rollouts  # and nothing banked by the engine beside it
    assert dt.buffer.tokens > 0
    assert {s[2] for s in dt.buffer.segments} >= {0, 1}  # tagged with the policy version that sampled it
    assert dt.buffer.dist.has.any()  # the top-k laws of completion positions came along
    dt.train_steps(2)
    assert dt.version >= 1
    engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=1.0, max_new_tokens=4, n=1, seed=0))
    assert engine.speculation.version() == dt.version  # the engine drafts with the newest published version


def test_grpo_feeds_the_drafter_from_its_old_logprob_pass(tiny_llama, char_tokenizer, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
                          logging_steps=1, learning_rate=1e-2, report_to="none", save_strategy="no",
                          disable_tqdm=True)
    data = make_math_dataset(16, seed=0)
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args, train_dataset=data,
                              processing_class=char_tokenizer, spec_config=SPEC,
                              engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    try:
        dt = fast_trainer(trainer.engine)
        # before the trainer's first rollout (a warm start, say) the engine still banks its own samples
        prompts = prompt_token_ids(char_tokenizer, data["prompt"][:1])
        trainer.engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))
        assert len(dt.buffer.segments) == 2 and not trainer.rollouts.drafter_feed.claimed
        trainer.train()
        check_fed(trainer, dt, rollouts=2 * 8, banked_before=2)
        for log in [r for r in trainer.state.log_history if "reward" in r]:
            assert log["sampling/sampling_logp_difference/max"] < 1e-4  # still lossless
    finally:
        trainer.engine.close()


def test_ppo_feeds_the_drafter_from_its_experience_pass(tiny_llama, char_tokenizer, tmp_path):
    args = PPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, report_to="none",
                     per_device_train_batch_size=4, num_mini_batches=2, num_generations=4, num_ppo_epochs=1,
                     max_completion_length=8, max_steps=2, learning_rate=1e-3, save_strategy="no",
                     disable_tqdm=True, kl_coef=0.05)
    trainer = PPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                         train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                         spec_config=SPEC, engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    try:
        dt = fast_trainer(trainer.engine)
        trainer.train()
        check_fed(trainer, dt, rollouts=2 * 8, banked_before=0)
    finally:
        trainer.engine.close()


def test_no_feed_without_online_training(tiny_llama, char_tokenizer, tmp_path):
    """Nothing trains the drafter online: no intake, no hooks, the trainer runs as before."""
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1,
                          report_to="none", save_strategy="no", disable_tqdm=True)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, selector="always", online_training=False)
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                              train_dataset=make_math_dataset(8, seed=0), processing_class=char_tokenizer,
                              spec_config=spec, engine_kwargs=dict(max_model_len=256, max_num_seqs=4))
    assert trainer.rollouts.drafter_feed is None
    tapped = [*tiny_llama.model.layers, tiny_llama.model.norm]  # what a feed would hook
    trainer.train()
    assert sum(len(m._forward_hooks) for m in tapped) == 0
    assert trainer.engine.speculation.learned.bank_samples  # nobody claimed the engine's banking
