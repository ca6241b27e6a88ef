"""EAGLE-3 save/load: the directory matches docs/export_format.md field by field, and round-trips.

The expected tables below are written out from docs/export_format.md for the tiny target of tests.conftest
(H=64, I=128, 4 heads, 2 kv heads, head_dim 16, V=96, 2 layers), not derived from the code under test.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlspec.rollout.speculation.drafters.eagle3_io import load_eagle3, save_eagle3
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.rotary import rope_table
from tests.conftest import make_tiny_hf

H, I, NH, NKV, HD, V, VD = 64, 128, 4, 2, 16, 96, 48
EXPECTED_TENSORS = {  # name -> shape, from docs/export_format.md#tensors (q/k/v take 2H inputs, fc takes 3H)
    "fc.weight": (H, 3 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (NH * HD, 2 * H),
    "midlayer.self_attn.k_proj.weight": (NKV * HD, 2 * H),
    "midlayer.self_attn.v_proj.weight": (NKV * HD, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, NH * HD),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (I, H),
    "midlayer.mlp.up_proj.weight": (I, H),
    "midlayer.mlp.down_proj.weight": (H, I),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
}
# the tiny target has 2 layers, so its only usable HF hidden_states index is 1 (repeated 3 times)
pytestmark = pytest.mark.filterwarnings("ignore:aux_layer_ids .* repeat a layer")


@pytest.fixture(scope="module")
def target():
    hf = make_tiny_hf("llama")
    return hf, ModelConfig.from_hf(hf.config)


def make_drafter(cfg: ModelConfig, draft_vocab: int | None = VD, seed: int = 0) -> Eagle3Model:
    torch.manual_seed(seed)
    model = Eagle3Model(Eagle3Config.for_target(cfg, draft_vocab_size=draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.dim() == 1 else 0.1 * torch.randn_like(p))
    if model.cfg.draft_vocab_size < cfg.vocab_size:
        model.set_draft_vocab(torch.randperm(cfg.vocab_size)[:model.cfg.draft_vocab_size])
    return model


def run_forward(model: Eagle3Model, cfg: ModelConfig, seed: int = 1) -> torch.Tensor:
    """Two draft steps (target features, then the drafter's own output) with causal attention."""
    g = torch.Generator().manual_seed(seed)
    B, T = 2, 7
    cos, sin = (t[None, :, None].expand(B, T, 1, HD) for t in rope_table(cfg, T, "cpu"))  # init_rope's tables
    feats, embeds = torch.randn(B, T, 3 * H, generator=g), torch.randn(B, T, H, generator=g)
    out = model(feats, embeds, cos, sin, attend)
    out2 = model(out, embeds, cos, sin, attend)
    return torch.cat([model.logits(out), model.logits(out2)])


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def test_config_json_has_every_field_of_the_format(target, tmp_path):
    hf, cfg = target
    out = save_eagle3(make_drafter(cfg), hf.config, str(tmp_path / "d"))
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
        "head_dim": HD, "rms_norm_eps": hf.config.rms_norm_eps, "vocab_size": V, "draft_vocab_size": VD,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
        "eagle_aux_hidden_state_layer_ids": [1, 1, 1],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0], "use_aux_hidden_state": True},
    }
    assert {k: c.get(k, "<missing>") for k in expected} == expected
    assert out == str((tmp_path / "d").resolve())
    meta = json.loads((tmp_path / "d" / "rlspec_drafter.json").read_text())
    assert meta["format"] == "eagle3" and meta["dtype"] == "bfloat16"


def test_layer_ids_are_hf_indices_for_vllm_and_one_less_for_sglang(tmp_path):
    import transformers as tf

    big = ModelConfig.from_hf(tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=8,
                                             num_attention_heads=NH, num_key_value_heads=NKV))
    save_eagle3(make_drafter(big), big.hf_config, str(tmp_path / "d"))
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF hidden_states[2], [L//2], [L-3]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    assert load_eagle3(str(tmp_path / "d")).cfg.aux_layer_ids == (2, 4, 5)


def test_rope_scaling_is_copied_from_a_scaled_target(tmp_path):
    import transformers as tf

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hf_cfg = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=8,
                            num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=4096,
                            rope_parameters=rope)
    save_eagle3(make_drafter(ModelConfig.from_hf(hf_cfg)), hf_cfg, str(tmp_path / "d"))
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    assert c["rope_theta"] == 500000.0 and c["max_position_embeddings"] == 4096
    assert c["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert tf.AutoConfig.from_pretrained(str(tmp_path / "d")).rope_parameters == rope


def test_tensors_have_the_format_names_dtypes_and_shapes(target, tmp_path):
    hf, cfg = target
    model = make_drafter(cfg)
    save_eagle3(model, hf.config, str(tmp_path / "d"))
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == set(EXPECTED_TENSORS) | {"d2t"}
    assert not any("embed_tokens" in k or k.startswith("model.") for k in tensors)
    for name, shape in EXPECTED_TENSORS.items():
        assert tensors[name].dtype == torch.bfloat16 and tuple(tensors[name].shape) == shape, name
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (VD,)
    ids = torch.arange(VD) + d2t  # target id = draft id + d2t[draft id]
    assert ids.min() >= 0 and ids.max() < V and bool((ids.diff() > 0).all())
    assert torch.equal(ids, model.to_target(torch.arange(VD)))


def test_full_draft_vocab_writes_no_d2t_and_loads_as_identity(target, tmp_path):
    hf, cfg = target
    save_eagle3(make_drafter(cfg, draft_vocab=None), hf.config, str(tmp_path / "d"))
    assert "d2t" not in load_file(str(tmp_path / "d" / "model.safetensors"))
    loaded = load_eagle3(str(tmp_path / "d"))
    assert loaded.cfg.draft_vocab_size == V and not loaded.d2t.any()


def test_float32_round_trip_is_exact(target, tmp_path):
    hf, cfg = target
    model = make_drafter(cfg)
    save_eagle3(model, hf.config, str(tmp_path / "d"), dtype=torch.float32)
    loaded = load_eagle3(str(tmp_path / "d"))
    assert loaded.cfg == model.cfg and torch.equal(loaded.d2t, model.d2t)
    with torch.no_grad():
        assert torch.equal(run_forward(loaded, cfg), run_forward(model, cfg))


def test_bf16_round_trip_is_within_bf16_rounding(target, tmp_path):
    hf, cfg = target
    model = make_drafter(cfg)
    save_eagle3(model, hf.config, str(tmp_path / "d"))  # bfloat16 by default
    loaded = load_eagle3(str(tmp_path / "d"))
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, p.detach().bfloat16().float()), name
    with torch.no_grad():
        a, b = run_forward(model, cfg), run_forward(loaded, cfg)
    assert (a - b).abs().max() <= 0.02 * a.abs().max()


def test_load_names_what_is_wrong(target, tmp_path):
    hf, cfg = target
    save_eagle3(make_drafter(cfg), hf.config, str(tmp_path / "d"), dtype="float32")
    weights = tmp_path / "d" / "model.safetensors"
    good = load_file(str(weights))
    cases = {"missing: norm.weight": {k: v for k, v in good.items() if k != "norm.weight"},
             "wrong shape: fc.weight": {**good, "fc.weight": torch.zeros(H, 2 * H)},
             "unexpected: extra.weight": {**good, "extra.weight": torch.zeros(1)},
             "has no d2t": {k: v for k, v in good.items() if k != "d2t"}}
    for message, tensors in cases.items():
        save_file(tensors, str(weights))
        with pytest.raises(ValueError, match=message):
            load_eagle3(str(tmp_path / "d"))
    save_file({**good, "embed_tokens.weight": torch.zeros(V, H), "t2d": torch.zeros(V, dtype=torch.bool)},
              str(weights))
    assert load_eagle3(str(tmp_path / "d")).cfg.vocab_size == V  # third-party extras are ignored


def test_save_replaces_a_drafter_atomically_but_never_a_foreign_directory(target, tmp_path):
    hf, cfg = target
    out = tmp_path / "d"
    save_eagle3(make_drafter(cfg, seed=0), hf.config, str(out), dtype="float32")
    second = make_drafter(cfg, seed=1)
    save_eagle3(second, hf.config, str(out), dtype="float32")
    assert torch.equal(load_eagle3(str(out)).fc.weight, second.fc.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp dirs left behind
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(FileExistsError, match="not an EAGLE-3 drafter"):
        save_eagle3(second, hf.config, str(foreign))


def test_repeated_layer_ids_warn_that_engines_cannot_run_them(target, tmp_path):
    hf, cfg = target
    with pytest.warns(UserWarning, match="repeat a layer"):
        save_eagle3(make_drafter(cfg), hf.config, str(tmp_path / "d"))


def test_vocab_mismatch_with_the_target_is_an_error(target, tmp_path):
    hf, cfg = target
    with pytest.raises(ValueError, match="vocab_size is 128"):
        save_eagle3(make_drafter(cfg), {**hf.config.to_dict(), "vocab_size": 128}, str(tmp_path / "d"))
