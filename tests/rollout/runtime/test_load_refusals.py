"""Model features the runtime does not compute are refused by name at load; the harmless look-alikes real
configs carry are not.

Refused: position-dependent RoPE (dynamic, longrope), attention layer kinds other than full/sliding, and an
lm_head contradicting tie_word_embeddings. Accepted: sliding windows (computed: test_families.py; one no position
can reach costs nothing), windows that are off, and the static RoPE variants, which match transformers.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.errors import UnsupportedModelError, WeightSyncError
from rlspec.rollout.runtime.graphs import build_step_batch
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.runner import ModelRunner
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.runtime.test_model_parity import ATOL, _ours_full_logits

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _qwen2_window(**kw) -> tf.Qwen2Config:
    return tf.Qwen2Config(**SMALL, **kw)


def test_a_window_sequences_cross_is_computed_not_refused():
    hf = tf.Qwen2ForCausalLM(_qwen2_window(use_sliding_window=True, sliding_window=64, max_window_layers=1)).eval()
    model = loader.from_hf_model(hf)
    assert model.cfg.windows == (False, True) and model.cfg.sliding_window == 64
    RolloutEngine(model, None, max_model_len=128)  # sequences cross the window: test_families checks the arithmetic


def test_a_window_no_position_reaches_adds_no_mask():
    """Mistral configs often carry a window as long as the model: with a cache shorter than it, no layer gets
    a mask of its own (the forward is Llama's)."""
    model = loader.from_hf_model(tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=512)).eval())
    assert model.cfg.windows == (True, True)
    runner = ModelRunner(model, "cpu", torch.float32)
    runner.ensure_cache(1, 64).reserve_rows(1, 64)
    fb = build_step_batch(torch.tensor([[5]]), torch.tensor([3]), runner.cache, 8)
    assert all(mask is fb.attn for mask in model.layer_masks(fb))


@pytest.mark.parametrize("config", [
    _qwen2_window(use_sliding_window=False, sliding_window=64),  # the window is off
    tf.MistralConfig(**SMALL, sliding_window=None),
    tf.LlamaConfig(**SMALL),
], ids=["qwen2-window-off", "mistral-no-window", "llama"])
def test_windows_that_change_nothing_are_accepted(config):
    cfg = ModelConfig.from_hf(config)
    assert cfg.windows == () and cfg.sliding_window is None


def test_a_window_the_qwen2_layer_types_do_not_use_is_accepted():
    config = _qwen2_window(use_sliding_window=True, sliding_window=64, max_window_layers=2)  # no layer >= 2
    assert "sliding_attention" not in config.layer_types
    assert ModelConfig.from_hf(config).windows == ()


def test_unknown_attention_layer_types_are_refused_by_name():
    config = tf.LlamaConfig(**SMALL)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match=r"\['linear_attention'\].*trl\.GRPOTrainer"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 256},
], ids=["dynamic", "longrope"])
def test_position_dependent_rope_is_refused_by_name(rope):
    config = tf.LlamaConfig(**SMALL, rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match=f"RoPE type '{rope['rope_type']}'.*trl.GRPOTrainer"):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128},
], ids=["linear", "llama3", "yarn"])
def test_static_rope_variants_are_accepted_and_match_transformers(rope):
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, rope_parameters=rope, initializer_range=0.1)).float().eval()
    ids = random_prompts(1, 12, 12)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _ours_full_logits(loader.from_hf_model(hf), ids)
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()


def _saved(tmp_path, tie: bool, claim_tie: bool) -> str:
    """A tiny checkpoint saved with tie=`tie` whose config.json then claims tie_word_embeddings=`claim_tie`."""
    hf = make_tiny_hf("llama", tie=tie)
    if not tie:
        with torch.no_grad():
            hf.lm_head.weight.add_(1.0)  # an untied head differs from the embedding
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = claim_tie
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_config_claiming_tied_embeddings_over_an_untied_head_is_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="tie_word_embeddings is True but the lm_head.weight sent differs"):
        loader.load_model(_saved(tmp_path, tie=False, claim_tie=True), dtype="float32")


def test_a_config_claiming_an_untied_head_the_checkpoint_lacks_is_refused(tmp_path):
    with pytest.raises(WeightSyncError, match=r"never written: \['lm_head.weight'\].*tie_word_embeddings=True"):
        loader.load_model(_saved(tmp_path, tie=True, claim_tie=False), dtype="float32")


@pytest.mark.parametrize("tie", [False, True])
def test_consistent_checkpoints_still_load(tmp_path, tie):
    model = loader.load_model(_saved(tmp_path, tie=tie, claim_tie=tie), dtype="float32")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
