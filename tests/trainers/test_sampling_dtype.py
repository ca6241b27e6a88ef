"""rlspec.trainers.sampling_dtype: rollouts are sampled in the trainer's compute dtype, not the master weights' dtype.

A float32 model trained with bf16=True must be sampled in bf16 by every backend (as vLLM would), float32 only when
asked; cast_lm_head_to_fp32 keeps a float32 head over the 16-bit body, the product TRL's forward computes.
"""
from __future__ import annotations

import types

import pytest
import torch
import trl

from tests.trainers.conftest import build_tiny_llama
from rlspec.trainers import sampling_dtype as sd
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer


def _args(**kw):
    return types.SimpleNamespace(**{"bf16": False, "fp16": False, **kw})



@pytest.fixture
def native_bf16(monkeypatch):
    """A CPU with native bf16 (the rule under test; a CPU without it samples in float32, tested below)."""
    monkeypatch.setattr(sd, "cpu_supports", lambda dtype: True)

def test_the_compute_dtype_wins_over_the_storage_dtype(tiny_llama, native_bf16):
    assert tiny_llama.dtype == torch.float32
    cpu = torch.device("cpu")
    assert sd.sampling_dtype(_args(bf16=True), tiny_llama, device=cpu) == torch.bfloat16
    assert sd.sampling_dtype(_args(), tiny_llama, device=cpu) == torch.float32
    # what the user asked for always wins, named or as a dtype
    assert sd.sampling_dtype(_args(bf16=True), tiny_llama, "float32", cpu) == torch.float32
    assert sd.sampling_dtype(_args(), tiny_llama, torch.bfloat16, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown sampling dtype"):
        sd.sampling_dtype(_args(), tiny_llama, "int8", cpu)


def test_fp16_and_the_configs_own_16_bit_dtype(tiny_llama, monkeypatch):
    monkeypatch.setattr(sd, "cpu_supports", lambda dtype: True)  # the rule, apart from this CPU's features
    cuda = torch.device("cuda")  # never touched: only its type is read
    assert sd.sampling_dtype(_args(fp16=True), tiny_llama, device=cuda) == torch.float16
    tiny_llama.config.dtype = torch.bfloat16  # a checkpoint saved in bf16, loaded in float32, no mixed precision
    assert sd.sampling_dtype(_args(), tiny_llama, device=cuda) == torch.bfloat16
    tiny_llama.config.dtype = "float32"
    assert sd.sampling_dtype(_args(), tiny_llama, device=cuda) == torch.float32


def test_a_cpu_without_native_16_bit_arithmetic_samples_in_float32(tiny_llama, monkeypatch, caplog):
    monkeypatch.setattr(sd, "cpu_supports", lambda dtype: False)
    with caplog.at_level("WARNING"):
        assert sd.sampling_dtype(_args(bf16=True), tiny_llama, device="cpu") == torch.float32
    assert "no native" in caplog.text
    # on a GPU the CPU's features do not matter
    assert sd.sampling_dtype(_args(bf16=True), tiny_llama, device="cuda") == torch.bfloat16


def _trainer(model, tokenizer, tmp_path, **args):
    config = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, seed=0, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, max_steps=1, report_to="none",
                            save_strategy="no", disable_tqdm=True, **args)
    return SpecGRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                           args=config, train_dataset=make_math_dataset(8, seed=0), processing_class=tokenizer,
                           engine_kwargs=dict(max_model_len=128, max_num_seqs=4,
                                              compile_mode="off"))  # no C++ of compiled steps here


def test_the_drop_in_samples_a_float32_model_in_bf16_under_bf16_mixed_precision(tiny_llama, char_tokenizer, native_bf16,
                                                                                  tmp_path):
    trainer = _trainer(tiny_llama, char_tokenizer, tmp_path, bf16=True)
    engine_dtype = next(trainer.engine.runner.model.parameters()).dtype
    assert tiny_llama.dtype == torch.float32 and engine_dtype == torch.bfloat16
    # TRL's default would drop whole samples over summed rounding: token-level truncation instead
    assert trainer.vllm_importance_sampling_mode == "token_truncate"
    trainer.train()  # the weight sync casts float32 master weights into the bf16 engine
    log = next(entry for entry in trainer.state.log_history if "reward" in entry)
    # TRL's importance-sampling correction sees bf16 sampling logprobs against float32 recomputed ones: close,
    # not equal (0 would mean the engine still sampled in float32)
    assert 0 < log["sampling/sampling_logp_difference/mean"] < 0.1


def test_sampling_in_the_storage_dtype_keeps_trls_importance_sampling_default(tiny_llama, char_tokenizer,
                                                                             tmp_path):
    config = trl.GRPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=True, per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, report_to="none")
    trainer = SpecGRPOTrainer(model=tiny_llama, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=config, train_dataset=make_math_dataset(8, seed=0), processing_class=char_tokenizer,
                              engine_kwargs=dict(max_model_len=128, max_num_seqs=4, dtype="float32"))
    assert next(trainer.engine.runner.model.parameters()).dtype == torch.float32
    assert trainer.vllm_importance_sampling_mode == "sequence_mask"


def test_masked_fractions_count_what_trls_correction_zeroed():
    from rlspec.trainers.trl_compat import masked_fractions

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    seq = {"importance_sampling_ratio": torch.tensor([[0.0], [1.2], [0.0]]), "completion_mask": mask}
    out = masked_fractions(seq, "sequence_mask")
    assert out["sampling/is_masked_sequence_frac"] == pytest.approx(2 / 3)
    assert out["sampling/is_masked_token_frac"] == pytest.approx(7 / 9)
    tok = {"importance_sampling_ratio": torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0], [1.0] * 4]),
           "completion_mask": mask}
    out = masked_fractions(tok, "token_mask")  # padding's zeros are not masked tokens; row 1 lost all it had
    assert out["sampling/is_masked_token_frac"] == pytest.approx(3 / 9)
    assert out["sampling/is_masked_sequence_frac"] == pytest.approx(1 / 3)
    assert masked_fractions(tok, "token_truncate")["sampling/is_masked_token_frac"] == 0.0


def test_cast_lm_head_to_fp32_keeps_a_float32_head_over_the_bf16_body(char_tokenizer, tmp_path, native_bf16):
    model = build_tiny_llama(len(char_tokenizer), char_tokenizer.eos_token_id, char_tokenizer.pad_token_id)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 3)  # untied, sharp
    trainer = _trainer(model, char_tokenizer, tmp_path, bf16=True, cast_lm_head_to_fp32=True)
    runtime = trainer.engine.runner.model
    assert runtime.lm_head.weight.dtype == torch.float32
    assert runtime.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    # the engine's logits are TRL's product: the bf16 body's normed hidden state in float32 times a float32 head
    ids = torch.tensor([char_tokenizer.encode("What is 7 + 5?")])
    reference = model.to(torch.bfloat16)
    reference.lm_head.to(torch.float32)
    with torch.no_grad():
        hidden = reference.model(ids).last_hidden_state
        expected = reference.lm_head(hidden.float())[0, -1]
    got = _engine_last_logits(trainer.engine, ids[0].tolist())
    assert torch.allclose(got, expected, atol=2e-2, rtol=0), (got - expected).abs().max()
    # a bf16 head rounds every logit to a bf16 value; a float32 product almost never lands on one
    assert (got != got.bfloat16().float()).float().mean() > 0.9


def _engine_last_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The target's float32 logits after `prompt`, from a prefill of the engine's runtime model."""
    from rlspec.rollout.runtime.runner import ModelRunner

    model = engine.runner.model
    runner = ModelRunner(model, "cpu", next(model.parameters()).dtype)
    runner.ensure_cache(1, len(prompt) + 1).reserve_rows(1, len(prompt) + 1)
    logits, _ = runner.prefill([prompt], [0])
    return logits[0]
