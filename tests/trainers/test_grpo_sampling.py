"""SpecGRPOTrainer takes TRL's min_p, repetition_penalty and generation_kwargs to the engine; a generation_kwargs
key the engine does not implement (a beam search) leaves the run to TRL's own generation, named in one warning."""
from __future__ import annotations

import pytest
import trl

from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.sampling_args import SUPPORTED_GENERATION_KWARGS, engine_sampling, unsupported_generation_kwargs


def distinct_chars_reward(completions, **kwargs):
    return [float(len(set(c[0]["content"]))) for c in completions]


def _args(tmp_path, **sampling):
    return trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=12, max_steps=1, logging_steps=1, learning_rate=1e-2,
        report_to="none", save_strategy="no", disable_tqdm=True, **sampling)


def test_min_p_penalty_and_generation_kwargs_reach_the_engine(tiny_llama, char_tokenizer, tmp_path):
    """generation_kwargs win over the config fields, as in TRL; every rollout samples with them, speculating
    at every step; TRL's importance ratio stays 1: the engine's logprobs are the temperature-scaled policy's,
    what TRL recomputes (docs/verification.md#logprobs)."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SpecConfig
    from tests.rollout.spec_helpers import ScriptedDrafter

    engine = RolloutEngine(loader.from_hf_model(tiny_llama), char_tokenizer, spec=SpecConfig(drafter="ngram"),
                           max_model_len=256, max_num_seqs=8, eos_token_ids=[char_tokenizer.eos_token_id],
                           drafter=ScriptedDrafter(tiny_llama.config.vocab_size, corrupt=0.5))
    engine.speculation.force(Arm("scripted", 3, 1))
    asked = []
    real = engine.generate
    engine.generate = lambda prompts, params=None, **kw: asked.append(params) or real(prompts, params, **kw)
    args = _args(tmp_path, temperature=0.9, top_k=-1, min_p=0.05, repetition_penalty=1.1,
                 generation_kwargs={"repetition_penalty": 1.3, "top_p": 0.95})
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                              train_dataset=make_math_dataset(16, seed=0), processing_class=char_tokenizer,
                              engine=engine)
    assert trainer.engine_sampling == dict(temperature=0.9, top_p=0.95, top_k=0, min_p=0.05, repetition_penalty=1.3)
    trainer.train()
    assert asked and all((p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.9, 0.95, 0, 0.05, 1.3)
                         for p in asked)
    log = next(log for log in trainer.state.log_history if "reward" in log)
    assert log["rollout/spec_step_share"] > 0.5
    assert log["sampling/sampling_logp_difference/max"] < 1e-4
    assert abs(log["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_unsupported_generation_kwargs_key_goes_to_trl_generation_by_name(tiny_llama, char_tokenizer, tmp_path):
    """Beam sampling (plain TRL accepts it through transformers' generate) trains, through TRL's generation:
    one warning names the key and what the engine honours; rollout/engine logs 0."""
    args = _args(tmp_path, generation_kwargs={"top_k": 5, "num_beams": 2, "length_penalty": -0.1, "do_sample": True})
    with pytest.warns(UserWarning, match=r"\['length_penalty', 'num_beams'\] are not honoured by the engine.*'temperature'"):
        trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[distinct_chars_reward], args=args,
                                  train_dataset=make_math_dataset(8, seed=0), processing_class=char_tokenizer,
                                  engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    assert trainer.engine is None
    trainer.train()
    assert next(log for log in trainer.state.log_history if "reward" in log)["rollout/engine"] == 0.0


def test_sampling_only_generation_kwargs_stay_on_the_engine():
    """do_sample and one beam change nothing the engine does; do_sample=False is greedy decoding."""
    assert unsupported_generation_kwargs({"do_sample": True, "num_beams": 1, "length_penalty": 1.0, "top_k": 3}) == []
    assert unsupported_generation_kwargs({"num_beams": 4, "length_penalty": 1.0}) == ["length_penalty", "num_beams"]
    assert unsupported_generation_kwargs({"typical_p": 0.9}) == ["typical_p"]
    assert engine_sampling(0.8, None, None, None, None, {"do_sample": False})["temperature"] == 0.0
    assert engine_sampling(0.8, None, None, None, None, {"do_sample": True, "num_beams": 1})["temperature"] == 0.8


def test_engine_sampling_maps_trl_values_and_validates():
    assert engine_sampling(1.0, None, None, None, None, None) == dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                                                      repetition_penalty=1.0)
    assert set(SUPPORTED_GENERATION_KWARGS) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    with pytest.raises(ValueError, match="min_p"):
        engine_sampling(1.0, 1.0, 0, 1.5, 1.0, None)
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine_sampling(1.0, 1.0, 0, None, None, {"repetition_penalty": 0.0})


def test_a_model_with_its_own_generate_is_sampled_by_it(tiny_llama, char_tokenizer, tmp_path):
    """A class that overrides generate (custom decoding), or a patched GenerationMixin.generate, is what TRL's
    generation would run: the engine cannot reproduce it, so the trainer builds no engine and every rollout of a
    training step comes from that generate; once the patch is gone the model is the engine's again."""
    from unittest import mock

    from rlspec.trainers.trl_compat import why_not_the_engine

    assert why_not_the_engine(tiny_llama, None) is None
    calls = []

    class CustomDecoding(type(tiny_llama)):
        def generate(self, *args, **kwargs):
            calls.append(kwargs.get("input_ids", args[0] if args else None))
            return super().generate(*args, **kwargs)

    custom = CustomDecoding(tiny_llama.config)
    custom.load_state_dict(tiny_llama.state_dict())
    assert "generate is not transformers' own" in why_not_the_engine(custom, None)
    with mock.patch("transformers.GenerationMixin.generate"):
        assert "generate is not transformers' own" in why_not_the_engine(tiny_llama, None)
    assert why_not_the_engine(tiny_llama, None) is None  # read at each call, not cached from the patched one

    trainer = SpecGRPOTrainer(model=custom, reward_funcs=[distinct_chars_reward], args=_args(tmp_path),
                              train_dataset=make_math_dataset(8, seed=0), processing_class=char_tokenizer,
                              engine_kwargs=dict(max_model_len=256, max_num_seqs=8))
    assert trainer.engine is None
    trainer.train()
    assert calls, "the model's own generate never ran"
    assert next(log for log in trainer.state.log_history if "reward" in log)["rollout/engine"] == 0.0
