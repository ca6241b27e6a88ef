"""rlspec.trainers.trl_compat: what plain trl.GRPOTrainer accepts, SpecGRPOTrainer runs.

A model the engine cannot run trains on TRL's own generation (with a warning, rollout/engine = 0, checkpoints
and resume included); every loss_type and importance-sampling mode runs on the engine (rollout/engine = 1);
VLMs are refused at construction; a rollout_func gets the trainer with an engine synced to the policy.
"""
from __future__ import annotations

import logging

import pytest
import torch
import trl

from rlspec.rollout.types import SamplingParams
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.trl_compat import ENGINE_METRIC


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def grpo_args(tmp_path, **overrides) -> trl.GRPOConfig:
    kwargs = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=4,
                  num_generations=2, max_completion_length=6, max_steps=1, logging_steps=1, learning_rate=1e-2,
                  report_to="none", save_strategy="no", disable_tqdm=True)
    return trl.GRPOConfig(**{**kwargs, **overrides})


def trainer_for(model, tokenizer, args, **kwargs) -> SpecGRPOTrainer:
    return SpecGRPOTrainer(model=model, reward_funcs=[distinct_chars_reward], args=args,
                           train_dataset=make_math_dataset(8, seed=0), processing_class=tokenizer,
                           engine_kwargs=dict(max_model_len=256, max_num_seqs=8), **kwargs)


def step_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "reward" in log]


def tiny_gpt2(tokenizer):
    """A model family rlspec's runtime does not compute (model_type gpt2), which plain TRL trains."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=256,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = GPT2LMHeadModel(config).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# ---- 1. an unsupported model trains on TRL's generation ---------------------------------------------------------

def test_unsupported_model_trains_on_trl_generation_and_resumes(char_tokenizer, tmp_path):
    args = grpo_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.warns(UserWarning, match="cannot sample this run as TRL would .*gpt2") as caught:
        trainer = trainer_for(tiny_gpt2(char_tokenizer), char_tokenizer, args)
    assert sum("TRL's own generation" in str(w.message) for w in caught) == 1  # warned once, saying why
    assert trainer.engine is None and trainer.rollouts is None
    assert not trainer.use_vllm  # plain TRL's IS settings: no correction without vLLM
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2 and all(log[ENGINE_METRIC] == 0.0 for log in logs)
    assert not any(key.startswith("sampling/") for key in logs[0])
    straight = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    # resume from step 1 (no engine state in the checkpoint): the run continues to the same weights
    args = grpo_args(tmp_path, max_steps=2, save_strategy="no")
    with pytest.warns(UserWarning, match="TRL's own generation"):
        resumed = trainer_for(tiny_gpt2(char_tokenizer), char_tokenizer, args)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    state = torch.load(tmp_path / "out" / "checkpoint-1" / "rlspec_state.pt", weights_only=True)
    assert state["engine"] is None
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, straight[name], rtol=0, atol=1e-6, msg=name)


def test_fsdp_generates_through_trl_without_building_an_engine():
    from rlspec.trainers.trl_compat import engine_or_trl_generation

    def build():
        raise AssertionError("an FSDP run must not build an engine it cannot sync")

    with pytest.warns(UserWarning, match="FSDP-sharded"):
        assert engine_or_trl_generation(build, engine_given=False, fsdp=True) is None


def test_supported_model_logs_engine_metric(tiny_llama, char_tokenizer, tmp_path):
    trainer = trainer_for(tiny_llama, char_tokenizer, grpo_args(tmp_path))
    trainer.train()
    assert step_logs(trainer)[0][ENGINE_METRIC] == 1.0


# ---- 2. every loss_type and importance-sampling mode ------------------------------------------------------------

@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"])
def test_every_trl_loss_type_runs_on_the_engine(loss_type, tiny_llama, char_tokenizer, tmp_path, caplog):
    level = "sequence" if loss_type == "luspo" else "token"  # TRL: luspo needs sequence-level, vespo token-level
    args = grpo_args(tmp_path, loss_type=loss_type, importance_sampling_level=level)
    with caplog.at_level(logging.INFO, logger="rlspec.trainers.trl_compat"):
        trainer = trainer_for(tiny_llama, char_tokenizer, args)
    if loss_type == "vespo":  # TRL's vespo takes a token-level correction: the default sequence_mask becomes token_mask
        assert trainer.vllm_importance_sampling_mode == "token_mask"
        assert "token_mask" in caplog.text
    else:
        assert trainer.vllm_importance_sampling_mode == "sequence_mask"
    trainer.train()
    log = step_logs(trainer)[0]
    assert log[ENGINE_METRIC] == 1.0
    assert torch.isfinite(torch.tensor(log["loss"]))
    assert log["sampling/sampling_logp_difference/max"] < 1e-4  # the correction ran, on-policy


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "off"])
def test_every_importance_sampling_mode_runs(mode, tiny_llama, char_tokenizer, tmp_path):
    settings = (dict(vllm_importance_sampling_correction=False) if mode == "off"
                else dict(vllm_importance_sampling_mode=mode))
    trainer = trainer_for(tiny_llama, char_tokenizer, grpo_args(tmp_path, **settings))
    assert trainer.use_vllm == (mode != "off")
    trainer.train()
    log = step_logs(trainer)[0]
    assert log[ENGINE_METRIC] == 1.0
    if mode == "off":  # as plain TRL with the correction off: no sampling/* metrics
        assert "sampling/importance_sampling_ratio/mean" not in log
    else:
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)


# ---- 3. VLMs are refused at construction ------------------------------------------------------------------------

def test_vision_language_processor_is_refused_at_construction(tiny_llama, char_tokenizer, tmp_path):
    from transformers import ProcessorMixin

    class TinyVLMProcessor(ProcessorMixin):  # what TRL tests for: a ProcessorMixin processing class
        attributes = ["tokenizer"]
        tokenizer_class = "AutoTokenizer"

    with pytest.raises(ValueError, match="use trl.GRPOTrainer"):
        trainer_for(tiny_llama, TinyVLMProcessor(tokenizer=char_tokenizer), grpo_args(tmp_path))


# ---- 4. rollout_func: the custom rollout samples from trainer.engine --------------------------------------------

def engine_rollout(prompts, trainer):
    """A custom rollout that speculates through the trainer's engine (TRL calls rollout_func(prompts, trainer),
    each prompt already repeated num_generations times)."""
    tok = trainer.processing_class
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for p in prompts]
    results = trainer.engine.generate(prompt_ids, SamplingParams(
        temperature=trainer.temperature, max_new_tokens=trainer.max_completion_length, n=1,
        seed=trainer.state.global_step,
        stop_token_ids=list(trainer.eos_token_ids)))
    return {"prompt_ids": prompt_ids, "completion_ids": [r.completion_ids for r in results],
            "logprobs": [r.logprobs for r in results]}


def test_rollout_func_samples_from_the_synced_engine(tiny_llama, char_tokenizer, tmp_path):
    trainer = trainer_for(tiny_llama, char_tokenizer, grpo_args(tmp_path, max_steps=2), rollout_func=engine_rollout)
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2
    assert trainer.engine.policy_version == 1  # synced before step 2's rollout, by the trainer
    for log in logs:  # the engine holds the policy of each step: TRL's recomputed logprobs equal the custom rollout's
        assert log["sampling/sampling_logp_difference/max"] < 1e-4
        assert log[ENGINE_METRIC] == 1.0 and log["rollout/num_sequences"] == 4


def test_rollout_func_without_logprobs_trains_uncorrected(tiny_llama, char_tokenizer, tmp_path):
    def no_logprobs(prompts, trainer):
        return {**engine_rollout(prompts, trainer), "logprobs": None}

    trainer = trainer_for(tiny_llama, char_tokenizer, grpo_args(tmp_path), rollout_func=no_logprobs)
    trainer.train()
    log = step_logs(trainer)[0]
    # no sampling logprobs: every ratio is exactly 1, as plain TRL (no correction without vLLM)
    assert log["sampling/importance_sampling_ratio/mean"] == 1.0 and torch.isfinite(torch.tensor(log["loss"]))
