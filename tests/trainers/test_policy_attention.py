"""trainers/policy_attention.py: a Gemma 2 policy on transformers' SDPA attention (which leaves out its soft-cap;
the default in transformers releases such as 5.17) is moved to eager attention, so TRL scores the engine's samples
under the law the engine sampled them from. The SDPA configuration is forced here: the transformers installed by
`make venv` already refuses SDPA for Gemma 2."""
from __future__ import annotations

import pytest
import torch
import trl

from rlspec.rollout.types import SamplingParams
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.policy_attention import eager_where_capped
from tests.rollout.family_helpers import make_family
from tests.rollout.test_engine_ar import engine_for


def _gemma2(vocab: int = 97, eos: int = 2, pad: int = 0):
    """A tiny Gemma 2 whose scores the cap of 2 bites."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                          query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=8.0,
                          max_position_embeddings=512, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def on_sdpa(model):
    """The model on SDPA attention, as transformers 5.17 loads a Gemma 2 (forced: later releases refuse it)."""
    model.config._attn_implementation = "sdpa"
    return model


def _logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The policy's logprobs of `completion` after `prompt`, as TRL computes them (one forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_a_capped_policy_on_sdpa_moves_to_eager_and_scores_what_the_engine_sampled_as_the_engine_did():
    model = on_sdpa(_gemma2())
    prompt = [5, 17, 33, 8, 61, 40]
    r = engine_for(model).generate([prompt], SamplingParams(temperature=0.7, max_new_tokens=12, seed=1,
                                                            ignore_eos=True))[0]
    engine = torch.tensor(r.logprobs)
    try:  # on SDPA, transformers computes another model than the one the engine samples from (5.17)...
        assert not torch.allclose(_logprobs(model, prompt, r.completion_ids, 0.7), engine, atol=1e-3)
    except ValueError as e:  # ... or refuses to (later releases, where only a forced SDPA gets this far)
        assert "softcap" in str(e)
    with pytest.warns(UserWarning, match="soft-caps its attention"):
        assert eager_where_capped(model, None) == 1
    assert model.config._attn_implementation == "eager"
    assert torch.allclose(_logprobs(model, prompt, r.completion_ids, 0.7), engine, atol=1e-4)
    # models that compute their attention as defined are left as they are
    for other in (make_family("gemma3"), make_family("mistral"), model):
        kind = other.config._attn_implementation
        assert eager_where_capped(other) == 0 and other.config._attn_implementation == kind


def test_grpo_on_a_capped_policy_is_lossless_with_its_reference_moved_too(char_tokenizer, tmp_path, monkeypatch):
    import trl.trainer.grpo_trainer as grpo_trainer

    path = tmp_path / "gemma2"  # TRL loads the policy and its reference (beta > 0) from it, on SDPA as 5.17 did
    _gemma2(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id).save_pretrained(path)
    load = grpo_trainer.create_model_from_path

    def load_on_sdpa(path, attn_implementation=None, **kwargs):  # TRL builds the reference on the policy's
        return on_sdpa(load(path, **kwargs))

    monkeypatch.setattr(grpo_trainer, "create_model_from_path", load_on_sdpa)
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                          per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
                          logging_steps=1, beta=0.04, report_to=[], save_strategy="no", disable_tqdm=True)
    with pytest.warns(UserWarning, match="policy and its reference now run eager attention"):
        trainer = SpecGRPOTrainer(model=str(path), reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                                  args=args, train_dataset=make_math_dataset(4, seed=0),
                                  processing_class=char_tokenizer, engine_kwargs=dict(max_model_len=256))
    assert trainer.model.config._attn_implementation == trainer.ref_model.config._attn_implementation == "eager"
    trainer.train()
    log = next(log for log in trainer.state.log_history if "sampling/sampling_logp_difference/max" in log)
    assert log["sampling/sampling_logp_difference/max"] < 1e-4  # TRL's logprobs are the engine's: on-policy
