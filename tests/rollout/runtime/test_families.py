"""The families beyond Llama/Qwen2/Qwen3 (Mistral and Qwen2 with sliding windows, Gemma 1/2/3, Qwen3-MoE, a
trust_remote_code Llama subclass): recognised by their classes, and computed as transformers computes them
(float32 logits through prefill, decode, chain and tree steps, windows crossed by every sequence)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from rlspec.rollout.errors import UnsupportedModelError
from rlspec.rollout.runtime.graphs import EagerRunner, build_step_batch, head_group
from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model import attention, loader
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.families import family_of_model
from rlspec.rollout.runtime.runner import ModelRunner
from tests.conftest import random_prompts
from tests.rollout.family_helpers import (COMMON, FAMILIES, WINDOW, CustomLlamaConfig, CustomLlamaForCausalLM,
                                          make_family)
from tests.rollout.runtime.test_attention import needs_compiler
from tests.rollout.runtime.test_model_parity import ATOL, _ours_full_logits


# ---- recognition ---------------------------------------------------------------------------------
def test_a_llama_subclass_with_its_own_model_type_is_a_llama():
    hf = make_family("custom_llama")
    assert hf.config.model_type == "custom_llama" and family_of_model(hf) == "llama"
    assert loader.from_hf_model(hf).cfg.model_type == "llama"


def test_a_subclass_overriding_forward_is_refused():
    class Patched(CustomLlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(UnsupportedModelError, match=r"Patched subclasses transformers' LlamaForCausalLM but defines "
                                                    r"its own \['forward'\].*trl\.GRPOTrainer"):
        family_of_model(Patched(CustomLlamaConfig(**COMMON)))


class MyMLP(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("swap", [MyMLP, torch.nn.Identity], ids=["custom", "torch-identity"])
def test_a_foreign_module_inside_a_known_family_is_refused(swap):
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    hf.model.layers[1].mlp = swap()
    with pytest.raises(UnsupportedModelError, match=rf"module 'model.layers.1.mlp' of the llama model is a .*"
                                                    rf"{swap.__name__}"):
        loader.from_hf_model(hf)


def test_other_classes_and_unknown_model_types_are_refused_by_name():
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not a causal LM rlspec's runtime computes"):
        loader.from_hf_model(hf)
    with pytest.raises(UnsupportedModelError, match="model_type 'custom_llama' is not one.*from_hf_model"):
        ModelConfig.from_hf(CustomLlamaConfig(**COMMON))  # a config alone does not say what code runs it


def test_layer_windows_follow_each_family_modeling():
    cfg = {k: ModelConfig.from_hf(make_family(k).config) for k in ("mistral", "qwen2_window", "gemma2", "gemma3")}
    assert cfg["mistral"].windows == (True,) * 3 and cfg["mistral"].sliding_window == WINDOW
    assert cfg["qwen2_window"].windows == (False, True, True)  # max_window_layers=1
    assert cfg["gemma2"].windows == (True, False, True)
    assert cfg["gemma3"].windows == (True, False, True) and cfg["gemma3"].layer_rope == ("sliding_attention", None,
                                                                                        "sliding_attention")
    assert ModelConfig.from_hf(tf.LlamaConfig(**COMMON, sliding_window=4)).windows == ()  # Llama never slides


def test_what_the_runtime_does_not_compute_is_still_refused():
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    config = tf.Qwen2Config(**COMMON)
    config.rope_parameters = rope  # only Gemma 3's modeling reads a RoPE per layer type
    with pytest.raises(UnsupportedModelError, match="per-layer-type RoPE parameters.*qwen2"):
        ModelConfig.from_hf(config)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(tf.Gemma3TextConfig(**COMMON, use_bidirectional_attention=True))
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):
        ModelConfig.from_hf(tf.LlamaConfig(**COMMON, hidden_act="relu"))


# ---- computation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_match_transformers(kind):
    """Prefill of one token, then 19 decode steps: every position past WINDOW attends through the window."""
    hf = make_family(kind)
    ours = loader.from_hf_model(hf)
    ids = random_prompts(1, 20, 20, seed=1)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _ours_full_logits(ours, ids)
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()
    if ours.cfg.windows:  # the window changes these logits: the test sees it
        ours.cfg = dataclasses.replace(ours.cfg, windows=())
        assert not torch.allclose(_ours_full_logits(ours, ids), ref, atol=ATOL)


@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gemma3"])
def test_windowed_batched_prefill_and_chain_step(kind):
    """Prompts longer and shorter than the window, prefilled together, then a 4-token chain step each."""
    hf = make_family(kind)
    prompts = random_prompts(3, 3, 12, seed=2)
    runner = ModelRunner(loader.from_hf_model(hf), "cpu", torch.float32)
    runner.ensure_cache(3, 32).reserve_rows(3, 32)
    last, _ = runner.prefill(prompts, [0, 1, 2])
    extra = torch.tensor([[5, 6, 7, 8]] * 3)
    step, _ = runner.step(extra, torch.tensor([len(p) for p in prompts]))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p + [5, 6, 7, 8]])).logits[0]
        assert torch.allclose(last[i], ref[len(p) - 1], atol=ATOL)
        assert torch.allclose(step[i], ref[len(p):], atol=ATOL)


def test_tree_nodes_attend_through_their_own_path_window():
    """A tree deeper than the window: node 6 (depth 5) sees its ancestors at depths 1..5 and not the root or the
    context, which its cache slot alone (start + 6) would not tell; each branch equals its own chain."""
    hf = make_family("gemma2")
    runner = ModelRunner(loader.from_hf_model(hf), "cpu", torch.float32)
    runner.ensure_cache(1, 32).reserve_rows(1, 32)
    p = random_prompts(1, 8, 8, seed=4)[0]
    runner.prefill([p], [0])
    parents = [-1, 0, 0, 2, 3, 4, 5]
    depths = torch.tensor([[0, 1, 1, 2, 3, 4, 5]])
    tree = torch.zeros(1, 7, 7, dtype=torch.bool)
    for i in range(7):
        j = i
        while j >= 0:
            tree[0, i, j], j = True, parents[j]
    tokens = [10, 11, 12, 13, 14, 15, 16]
    logits, _ = runner.step(torch.tensor([tokens]), torch.tensor([len(p)]), depths=depths, tree_mask=tree)
    with torch.no_grad():
        a = hf(torch.tensor([p + [10, 11]])).logits[0, -2:]
        b = hf(torch.tensor([p + [10, 12, 13, 14, 15, 16]])).logits[0, -6:]
    assert torch.allclose(logits[0, [0, 1]], a, atol=ATOL)
    assert torch.allclose(logits[0, [0, 2, 3, 4, 5, 6]], b, atol=ATOL)


def _paged(hf, B=5, length=384):
    """The runtime of `hf` over a pool of 128-position blocks (row r's block j is physical 1 + j * B + r, so rows
    interleave in the pool), prompts of 120-250 tokens prefilled: what CUDA's paged FlexAttention path reads.
    test_attention._paged_runner's shapes (5 rows, 384 positions): the CPU compiles paged FlexAttention per batch
    size, and a second batch size in one process makes dynamo try a dynamic batch, which torch 2.13's C++
    template fails to compile (attention._mark_shapes)."""
    model = loader.from_hf_model(hf)
    bs = attention.BLOCK
    cache = PagedKVCache(model.cfg, B, length, B * 3 + 1, bs, torch.float32, "cpu")
    for j in range(length // bs):
        cache.grow([(r, r, (j + 1) * bs) for r in range(B)])
    runner = ModelRunner(model, "cpu", torch.float32)
    runner.cache = cache
    model.init_rope(length)
    prompts = random_prompts(B, 120, 250, seed=3)
    runner.prefill(prompts, list(range(B)))
    return model, cache, torch.tensor([len(p) for p in prompts])


def _step(shape, B=5):
    T = 1 if shape == "decode" else 4
    tokens = torch.randint(3, 96, (B, T), generator=torch.Generator().manual_seed(5))
    if shape == "decode":
        return tokens, None, None
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    return tokens, torch.tensor([[0, 1, 1, 2]] * B), tree.repeat(B, 1, 1)


@pytest.mark.parametrize("shape", ["decode", "tree"])
def test_paged_flex_step_of_windowed_and_softcapped_layers_goes_dense(shape):
    """Gemma 2's sliding layers (a window across the 128-position blocks) and its soft-capped full layers
    attend densely through the rows' block tables on the paged flex path, equal to the dense step. Both kinds
    go dense, so no FlexAttention kernel is compiled here."""
    torch.manual_seed(0)
    hf = tf.Gemma2ForCausalLM(tf.Gemma2Config(**COMMON, sliding_window=150, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=2.0, final_logit_softcapping=4.0)).eval()
    model, cache, lens = _paged(hf)
    tokens, depths, tree = _step(shape)
    ref, _ = EagerRunner(model, cache, "cpu").run(tokens, lens, depths, tree)
    fb = build_step_batch(tokens, lens, cache, cache.length, depths, tree, flex=True, group=head_group(model))
    assert fb.blocks is None and fb.attn.block is not None
    assert all(m.dense is not None and m.block is None for m in model.layer_masks(fb))
    got, _ = model(fb, cache.k, cache.v)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


@needs_compiler
def test_paged_flex_full_layers_take_the_query_scale():
    """Gemma 3 on the paged flex path: full layers run FlexAttention with query_pre_attn_scalar's scale,
    sliding ones go dense; together equal to the dense step (FlexAttention compiled for the CPU)."""
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(**COMMON, sliding_window=150, query_pre_attn_scalar=24,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model, cache, lens = _paged(tf.Gemma3ForCausalLM(config).eval())
    tokens, _, _ = _step("decode")
    ref, _ = EagerRunner(model, cache, "cpu").run(tokens, lens)
    fb = build_step_batch(tokens, lens, cache, cache.length, flex=True, group=head_group(model))
    assert [m.block is not None for m in model.layer_masks(fb)] == [False, True, False]
    got, _ = model(fb, cache.k, cache.v)
    assert attention.flex_error() is None, attention.flex_error()
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def _trl_cast_lm_head_to_fp32(model):
    """What trl.GRPOTrainer does with cast_lm_head_to_fp32=True (grpo_trainer.py): the head's weight to float32
    (a tied embedding with it), its forward patched to a float32 product, a hook casting embeddings back."""
    dtype = model.lm_head.weight.dtype
    head = model.lm_head.float()
    model.lm_head = head
    head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight.float())
    if model.config.tie_word_embeddings:
        model.model.embed_tokens.register_forward_hook(lambda module, args, out: out.to(dtype))


@pytest.mark.parametrize("tie", [True, False])
def test_a_trl_fp32_head_keeps_the_body_dtype_and_the_tie(tie):
    """The runtime takes the decoder's dtype (bfloat16), not the first parameter's (the tied embedding, now
    float32), and keeps the tie; the head's weights arrive cast."""
    from tests.conftest import make_tiny_hf

    hf = make_tiny_hf("qwen2", tie=tie).to(torch.bfloat16)
    _trl_cast_lm_head_to_fp32(hf)
    assert hf.lm_head.weight.dtype == torch.float32 and hf.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ours = loader.from_hf_model(hf)
    assert ours.lm_head.weight.dtype == ours.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight.to(torch.bfloat16))


def test_a_qwen3_moe_checkpoint_of_per_expert_matrices_loads_into_the_fused_experts(tmp_path):
    """On disk transformers keeps one matrix per expert; each fills its slice of the fused tensor, which counts
    as written once every slice came (a missing one is named)."""
    from safetensors.torch import load_file, save_file

    from rlspec.rollout.errors import WeightSyncError

    hf = make_family("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ids = random_prompts(1, 10, 10, seed=5)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _ours_full_logits(loader.load_model(str(tmp_path), dtype="float32"), ids)
    assert torch.allclose(got, ref, atol=ATOL), (got - ref).abs().max()
    state = load_file(tmp_path / "model.safetensors")
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in state
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightSyncError, match=r"never written: \['model.layers.2.mlp.experts.gate_up_proj'\]"):
        loader.load_model(str(tmp_path), dtype="float32")
