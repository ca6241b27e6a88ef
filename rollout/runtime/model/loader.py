"""Load Hugging Face Llama-family weights into our runtime, from a directory or a live model.

HF keeps q/k/v and gate/up as separate matrices; our runtime fuses them. `load_named_tensors`
is the one place that maps names, used at load time and for every policy weight sync.

Qwen3-MoE experts come in two layouts: a live transformers model holds them fused per layer
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), as the runtime does; a checkpoint on
disk keeps one matrix per expert (`mlp.experts.{e}.gate_proj.weight`, ...), which load into slices of the fused
tensors (`_expert_slot`), the fused tensor counting as written once all its slices came.
"""
from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterable

import torch

from rlspec.rollout.errors import ModelNotFoundError, UnknownWeightError, UnsupportedModelError, WeightSyncError
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.families import family_of_model
from rlspec.rollout.runtime.model.llama import LlamaForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


# HF projection name part -> (our fused parameter's name part, index of the slice in the fusion)
_FUSIONS = {
    "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
    "self_attn.k_proj.": ("self_attn.qkv_proj.", 1),
    "self_attn.v_proj.": ("self_attn.qkv_proj.", 2),
    "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
    "mlp.up_proj.": ("mlp.gate_up_proj.", 1),
}


def _slices(cfg: ModelConfig, fused_part: str) -> list[tuple[int, int]]:
    """Row ranges of a fusion's slices, in _FUSIONS order."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if fused_part == "self_attn.qkv_proj.":
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    return [(0, inter), (inter, 2 * inter)]


def _fused_slot(cfg: ModelConfig, name: str) -> tuple[str, int, int] | None:
    """For an HF q/k/v/gate/up name, the fused parameter name and the row range it fills."""
    for hf_part, (ours, index) in _FUSIONS.items():
        if hf_part in name:
            start, stop = _slices(cfg, ours)[index]
            return name.replace(hf_part, ours), start, stop
    return None


def fused_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int, int]]:
    """For one of our fused parameter names, (HF name, start row, stop row) of each slice; [] otherwise."""
    return [(name.replace(ours, hf_part), *_slices(cfg, ours)[index])
            for hf_part, (ours, index) in _FUSIONS.items() if ours in name]


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _expert_slot(cfg: ModelConfig, name: str) -> tuple[str, tuple, int] | None:
    """For a per-expert checkpoint name: (fused parameter, index into it, slices that fill it); None otherwise."""
    m = _EXPERT.match(name)
    if m is None or not cfg.moe_layers or int(m.group(2)) >= cfg.num_experts:
        return None
    prefix, e, proj, inter = m.group(1), int(m.group(2)), m.group(3), cfg.moe_intermediate_size
    if proj == "down_proj":
        return f"{prefix}.down_proj", (e,), cfg.num_experts
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)  # gate rows first, as transformers
    return f"{prefix}.gate_up_proj", (e, rows), 2 * cfg.num_experts


def expected_names(model: LlamaForCausalLM) -> set[str]:
    """The HF names a complete load or sync must write once each (a tied lm_head is not among them)."""
    names = set()
    for name, _ in model.named_parameters():  # duplicates removed: a tied lm_head is the embedding
        parts = fused_parts(model.cfg, name)
        names.update([hf for hf, _, _ in parts] if parts else [name])
    return names


class WriteLedger:
    """Which HF-named tensors one load or sync has written, possibly over several load_named_tensors calls
    (the files of a sharded checkpoint, the buckets of a ZeRO-3 sync). `finish` checks nothing is missing."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.expected = expected_names(model)
        self.written: set[str] = set()
        self.tied_head: torch.Tensor | None = None  # an lm_head.weight sent to a tied model, checked in finish
        self.parts: dict[str, set[str]] = {}  # fused expert tensor -> the per-expert slices written so far

    def mark(self, name: str) -> None:
        if name in self.written:
            raise WeightSyncError(f"weight {name!r} was written twice in one load/sync: two sources claim the "
                                  "same tensor (duplicate names in the state dict, or a bucket sent twice)")
        self.written.add(name)

    def mark_part(self, name: str, fused: str, needed: int) -> None:
        """A per-expert slice of `fused`; the fused tensor is written once all `needed` slices came."""
        parts = self.parts.setdefault(fused, set())
        if name in parts:
            self.mark(name)  # raises: this slice came twice
        parts.add(name)
        if len(parts) == needed:
            self.mark(fused)  # raises if the fused tensor also came whole

    def finish(self) -> None:
        """Raise unless every expected tensor was written; check a tied lm_head agrees with the embedding."""
        missing = sorted(self.expected - self.written)
        if missing:
            head = ("; config.tie_word_embeddings is False but no lm_head.weight came: if the checkpoint ties its "
                    "embeddings, its config must say tie_word_embeddings=True") if "lm_head.weight" in missing else ""
            raise WeightSyncError(
                f"{len(missing)} of the {len(self.expected)} runtime tensors were never written: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}{head}. The engine would generate from stale or uninitialised "
                "weights; send every parameter of the policy (a ZeRO-3 sync must cover all buckets)")
        if self.tied_head is not None:
            embed = self.model.model.embed_tokens.weight
            if not torch.equal(self.tied_head.to(embed.device, embed.dtype), embed):
                raise UnsupportedModelError(
                    "config.tie_word_embeddings is True but the lm_head.weight sent differs from "
                    "model.embed_tokens.weight: the runtime would silently use the embedding as the output "
                    "layer. Fix the config (tie_word_embeddings=False) or keep the weights tied")


@torch.no_grad()
def load_named_tensors(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       ledger: WriteLedger | None = None) -> int:
    """Copy HF-named tensors into the runtime (dtype/device converted). Returns how many were loaded.

    ledger None: the call is one complete load, checked at its end (every runtime tensor written exactly
    once). A load spread over several calls passes one WriteLedger to each and calls ledger.finish() after
    the last. Unknown names, duplicates and shape mismatches raise at once: a silently skipped or misplaced
    tensor is how weight syncs corrupt a rollout engine.
    """
    own = ledger is None
    ledger = ledger or WriteLedger(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    count = 0
    for name, tensor in named_tensors:
        name = name.removeprefix("module.")
        if "rotary_emb" in name:
            continue
        fused, expert = _fused_slot(model.cfg, name), _expert_slot(model.cfg, name)
        target, rows = (fused[0], slice(fused[1], fused[2])) if fused else \
            (expert[0], expert[1]) if expert else (name, slice(None))
        if target not in params:
            raise UnknownWeightError(f"weight {name!r} has no place in rlspec's runtime ({model.cfg.model_type}); "
                                     f"is the checkpoint a {model.cfg.model_type} causal LM?")
        if expert:
            ledger.mark_part(name, target, expert[2])
        else:
            ledger.mark(name)
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            ledger.tied_head = tensor  # tied: the embedding holds it; finish() checks they agree
            continue
        dst = params[target][rows]
        if tuple(tensor.shape) != tuple(dst.shape):  # copy_ would broadcast a wrong shape silently
            raise WeightSyncError(f"weight {name!r} has shape {tuple(tensor.shape)}, the runtime expects "
                                  f"{tuple(dst.shape)}: the checkpoint's config does not match its weights")
        dst.copy_(tensor)
        count += 1
    if own:
        ledger.finish()
    return count


def hf_cache_arg(hf_model) -> str:
    """The name of the KV cache argument of a transformers model's forward: `cache` from transformers 5.24, which
    still takes `past_key_values` with a FutureWarning until 5.40; `past_key_values` before it."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def build_model(hf_config, dtype: torch.dtype, device: str | torch.device,
                family: str | None = None) -> LlamaForCausalLM:
    """family: what families.family_of_model found for a live model; None: the config's model_type names it."""
    cfg = ModelConfig.from_hf(hf_config, family)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)  # cast on meta: no float32 copy of the weights is ever made
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(path: str, dtype: str | torch.dtype = "bfloat16", device="cpu") -> LlamaForCausalLM:
    """Load a local HF directory (config.json + *.safetensors) into our runtime."""
    from safetensors import safe_open
    from transformers import AutoConfig

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {path!r}; pass a Hugging Face model directory")
    model = build_model(AutoConfig.from_pretrained(path), resolve_dtype(dtype), device)
    ledger = WriteLedger(model)  # one load over every shard file
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            load_named_tensors(model, ((k, st.get_tensor(k)) for k in st.keys()), ledger)
    ledger.finish()
    return model


def from_hf_model(hf_model, dtype: torch.dtype | None = None, device=None,
                  head_dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """Build our runtime from an in-memory transformers model (weights copied, not shared), recognised by its
    classes (families.family_of_model). dtype None: the decoder layers' dtype, not the first parameter's: TRL's
    cast_lm_head_to_fp32 turns a tied embedding (the first parameter) into float32 over a bfloat16 body."""
    family = family_of_model(hf_model)
    body = body_tensor(hf_model.named_parameters())
    model = build_model(hf_model.config, dtype or body.dtype, device or body.device, family)
    cast_head(model, head_dtype)
    load_named_tensors(model, hf_model.state_dict().items())  # checks every tensor came, once
    return model


def cast_head(model: LlamaForCausalLM, dtype: torch.dtype | str | None) -> None:
    """Keep the LM head in `dtype` (float32 for TRL's cast_lm_head_to_fp32) over the body's dtype; None: as is.
    TRL allows it only for an untied head, and so do we: a tied head is the embedding table."""
    if dtype is None:
        return
    dtype = resolve_dtype(dtype)
    if dtype == model.lm_head.weight.dtype:
        return
    if model.cfg.tie_word_embeddings:
        raise ValueError("a float32 LM head (cast_lm_head_to_fp32) needs untied embeddings "
                         "(config.tie_word_embeddings=False), as in TRL")
    model.lm_head.to(dtype)


def body_tensor(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """A decoder layer's tensor (else the first): the dtype and device the runtime takes by default."""
    named = list(named_tensors)
    return next((t for name, t in named if ".layers." in name), named[0][1])
