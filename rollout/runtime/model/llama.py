"""Our compact Llama-family runtime (the families of config.py) over a paged KV cache.

One forward takes T new tokens per sequence with their own RoPE positions, the cache indices to
write their keys/values at, and what they may attend to (attention.py). That single shape
serves batched prefill, plain decode (T=1), chain verification (T=k+1) and tree verification
(T=nodes, mask = ancestors), because rejected tokens are simply never made visible again.

Projections are fused (q|k|v and gate|up) to halve kernel launches, which dominate small-batch
decode on CPU and GPU alike; `loader.py` maps Hugging Face names onto the fused weights.

Family switches (ModelConfig) pick modules at construction (gemma.py's norms and scaled embedding, moe.py's
routed experts) or add an op only where set (sliding-window masks, soft-capping, a second RoPE table), so a
Llama runs exactly the ops it always ran.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlspec.rollout.runtime.model.attention import AttnMask, attend, attend_paged, dense_view
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model import fused_ops
from rlspec.rollout.runtime.model.fused_ops import activation_product, step_rotation
from rlspec.rollout.runtime.model.gemma import GemmaRMSNorm, ScaledEmbedding, softcap
from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.linear import Linear
from rlspec.rollout.runtime.model.moe import SparseMoE
from rlspec.rollout.runtime.model.rotary import rope, rope_table
from rlspec.rollout.runtime.kv_cache import gather_blocks, pool_sequence, write_slots


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: the same arithmetic (float32 statistics), so bf16 outputs match bit for bit, except where
    torch's fused kernel serves (`fused_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_norm(x, self.weight):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if torch.is_grad_enabled() and x.requires_grad:  # a drafter's training: out= has no gradient
            return self.weight * (x32 * r).to(x.dtype)
        # HF's (x32 * r).to(dtype) in one kernel: the float32 product rounded to x's dtype as it is stored
        return self.weight * torch.mul(x32, r, out=torch.empty_like(x))


def fused_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's fused RMSNorm kernel normalises x: on CUDA, outside autograd, x in the weight's dtype. There it
    is one kernel where HF's arithmetic takes seven (each a node of every CUDA graph, ~2 us a step each:
    docs/gpu.md#where-a-step-goes). It multiplies by the weight before rounding to x's dtype, where HF also rounds
    before the weight, so in bf16 a norm can differ from HF's in its last bit (in float32 only by the order of its
    sum); the CUDA parity tests hold in float32 (atol 1e-4, greedy tokens equal transformers')."""
    return x.is_cuda and x.dtype == weight.dtype and not (torch.is_grad_enabled() and x.requires_grad)


def plus_product(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear,
                 product=nn.Linear.__call__) -> torch.Tensor:
    """residual + product(linear, x): a layer's residual sum with the product that ends its attention or MLP. Where
    the norms are fused (`fused_norm`: CUDA inference) and the product has no bias, it is one kernel that adds the
    residual as it stores (addmm, beta 1, or our few-rows kernel: fused_ops.product): one kernel where the product
    and the sum take two, two a decoder layer (docs/gpu.md#where-a-step-goes). The sum is then rounded once, where
    HF rounds the product first, so in bf16 it can differ from HF's in its last bit (in float32 only by the order of
    the product's sums)."""
    if linear.bias is None and fused_norm(x, linear.weight):
        return fused_ops.product(x, linear.weight, None, residual)
    return residual + product(linear, x)


def activated_plus_product(act, residual: torch.Tensor, gate_up: torch.Tensor, inter: int,
                           linear: nn.Linear) -> torch.Tensor:
    """residual + linear(act(gate) * up) of an MLP's fused gate|up product: where the residual sum is fused
    (`plus_product`) and the activation is SiLU, one kernel for a few rows wherever that was measured faster
    (fused_ops.gated_product: SiLU times up inside few_rows.py's product), where SiLU's kernel and the product take
    two."""
    def unfused():
        return plus_product(residual, activation_product(act, gate_up, inter), linear)

    if act is F.silu and linear.bias is None and fused_norm(gate_up, linear.weight):
        return fused_ops.gated_product(gate_up, linear.weight, residual, unfused)
    return unfused()


def normed(norm: nn.Module | None, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(norm(x)) (linear(x) without a norm). Where torch's fused norm serves (`fused_norm`: CUDA inference),
    a Llama RMSNorm and the product of our Linear after it are one kernel for a few rows wherever that was measured
    faster (fused_ops.normed_product: the norm inside few_rows.py's product)."""
    if norm is None:
        return linear(x)
    if type(norm) is RMSNorm and isinstance(linear, Linear) and not linear.plain and fused_norm(x, norm.weight):
        return fused_ops.normed_product(x, norm.weight, norm.eps, linear.weight, linear.bias, lambda: linear(norm(x)))
    return linear(norm(x))


@dataclass
class ForwardBatch:
    """Tensors for one forward over B sequences with T new tokens each.

    input_ids, positions, write_index: [B, T] (long). positions are RoPE positions; write_index are
    cache positions (equal for chains, different for trees whose nodes share a depth).
    slots: [B, T] flat pool slots of write_index through each row's block table (kv_cache.py).
    attn: what the new tokens see (attention.py): a causal prefill among the new tokens only, or a
    step over the first attn.kv_len cache positions of each row.
    blocks: [B, attn.kv_len / block_size] the blocks a step gathers (rows 0..B-1); None for a prefill and
    for paged FlexAttention, which reads the pool through attn.block's physical indices.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_index: torch.Tensor
    attn: AttnMask
    slots: torch.Tensor
    blocks: torch.Tensor | None = None


def norm_class(cfg: ModelConfig) -> type[nn.Module]:
    return GemmaRMSNorm if cfg.gemma_norm else RMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        norm = norm_class(cfg)
        self.q_norm = norm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap  # None for all but Gemma 2/3

    def forward(self, x, cos, sin, k_cache, v_cache, fb: ForwardBatch, attn: AttnMask,
                residual: torch.Tensor | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        """attn: fb.attn, or the layer's own view of it (a sliding window, a dense mask: LlamaForCausalLM);
        residual: added to the output (`plus_product`); norm: applied to x first (`normed`)."""
        B, T, _ = x.shape
        qkv = normed(norm, self.qkv_proj, x).view(B, T, self.nh + 2 * self.nkv, self.hd)
        # cos/sin [B, T, 1, hd], sin signed: HF's rotation (`rope`)
        if self.q_norm is None and not attn.causal:  # a step: k and v are read back from the pool
            q = step_rotation(qkv)(qkv, cos, sin, k_cache, v_cache, fb.slots, self.nh, self.nkv)
        else:
            v = qkv[:, :, self.nh + self.nkv:]
            if self.q_norm is None:  # q and k rotate together
                q, k = rope(qkv, cos, sin, self.nh + self.nkv).split([self.nh, self.nkv], 2)
            else:
                q, k = rope(self.q_norm(qkv[:, :, :self.nh]), cos, sin), rope(
                    self.k_norm(qkv[:, :, self.nh:-self.nkv]), cos, sin)
            write_slots(k_cache, fb.slots, k)
            write_slots(v_cache, fb.slots, v)
        q, out = q.transpose(1, 2), None  # q [B, nh, T, hd]
        if attn.causal:  # fresh prompts see only each other
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        elif fb.blocks is not None and attn.dense is not None and self.softcap is None and \
                kernels.attention_usable(q, k_cache):  # CPU bf16: read in place from the pool (kernels/)
            out = kernels.paged_attention(q, k_cache, v_cache, fb.blocks, attn.dense,
                                          self.hd ** -0.5 if self.scale is None else self.scale)
        elif fb.blocks is not None:  # one gather of the rows' blocks: [B, KV, kv_len, hd]
            keys, values = gather_blocks(k_cache, fb.blocks), gather_blocks(v_cache, fb.blocks)
        elif attn.paged:  # CUDA: the Triton kernel reads the pool in place through the rows' block tables
            out = attend_paged(q, k_cache, v_cache, attn, self.scale)
        elif attn.block is not None:  # paged FlexAttention reads the pool itself, through its block mask
            keys, values = pool_sequence(k_cache), pool_sequence(v_cache)
        else:  # a dense view of a paged flex step (a sliding layer): gather through the rows' block table
            keys, values = gather_blocks(k_cache, attn.table), gather_blocks(v_cache, attn.table)
        if out is None:
            out = attend(q, keys, values, attn, self.scale, self.softcap)
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(out) if residual is None else plus_product(residual, out, self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                norm: nn.Module | None = None) -> torch.Tensor:
        """residual: added to the output (`plus_product`); norm: applied to x first (`normed`)."""
        gate_up = normed(norm, self.gate_up_proj, x)
        if residual is None:
            return self.down_proj(activation_product(self.act, gate_up, self.inter))  # CUDA: SiLU's in one kernel
        return activated_plus_product(self.act, residual, gate_up, self.inter, self.down_proj)


# transformers' ACT2FN entries for config.ACTIVATIONS: F.silu, and GELUTanh's gelu(approximate="tanh")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class DecoderLayer(nn.Module):
    """Llama's pre-norm block; with cfg.sandwich_norms Gemma 2/3's, whose post_attention_layernorm normalises
    the attention output (not the MLP input) and whose MLP sits between pre/post_feedforward_layernorm."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        norm, H, eps = norm_class(cfg), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = norm(H, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm(H, eps)
        self.mlp = SparseMoE(cfg, ACTIVATIONS[cfg.hidden_act]) if cfg.moe_layers and cfg.moe_layers[index] else MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(H, eps), norm(H, eps)

    def forward(self, x, cos, sin, k_cache, v_cache, fb, attn):
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache,
                                                                 fb, attn))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = self.self_attn(x, cos, sin, k_cache, v_cache, fb, attn, residual=x, norm=self.input_layernorm)
        if isinstance(self.mlp, MLP):
            return self.mlp(x, residual=x, norm=self.post_attention_layernorm)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale) \
            if cfg.embed_scale is not None else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm_class(cfg)(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror HF's (`model.layers.0.self_attn...`, `lm_head`) apart from the fusions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_cos: torch.Tensor | None = None  # [max_len, hd] float32, built by init_rope
        self.rope_sin: torch.Tensor | None = None  # signed: its first half negated (`rope`)
        self.rope_extra: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # other layer types' tables (Gemma 3)
        self._rope_in_dtype: tuple = (None, None, {})  # (rope_cos it was made from, dtype, tables): `rope_tables`

    def init_rope(self, max_len: int) -> None:
        """Precompute cos/sin tables in float32 exactly as HF computes them per position (sin signed, `rope`).
        Tables only grow: engines (or a drafter trainer) sharing one model must never shrink another's."""
        if self.rope_cos is not None and self.rope_cos.shape[0] >= max_len:
            return
        device = self.lm_head.weight.device
        self.rope_cos, self.rope_sin = rope_table(self.cfg, max_len, device)
        self.rope_extra = {t: rope_table(self.cfg, max_len, device, t)
                           for t in sorted({t for t in self.cfg.layer_rope if t is not None})}

    def rope_tables(self, dtype) -> dict:
        """{layer type: (cos, signed sin) [max_len, hd]} in the model's dtype, converted once per table (init_rope)
        where every step converted the rows it gathered: two kernels a step fewer (each a node of every CUDA graph),
        the same values (a conversion commutes with a gather)."""
        made_from, made_in, tables = self._rope_in_dtype
        if made_from is not self.rope_cos or made_in != dtype:
            with torch.inference_mode(False):  # ordinary tensors, whichever mode reads them
                tables = {t: (c.to(dtype), s.to(dtype))
                          for t, (c, s) in {None: (self.rope_cos, self.rope_sin), **self.rope_extra}.items()}
            self._rope_in_dtype = (self.rope_cos, dtype, tables)
        return tables

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, k_cache, v_cache, hidden_layers=(), logits_index=None, layer_call=None,
                float_logits: bool = True):
        """Run B x T new tokens; k_cache/v_cache: the paged pools [L, num_blocks, block_size, kv_heads, head_dim].

        Returns (logits, hiddens): logits [B, T, V] float32, or [B, V] when logits_index [B] picks
        one position per row (prefill); hiddens: {HF hidden_states index: [B, T, H]} for the layers
        asked for (index 0 = embeddings, i = output of layer i-1, for i <= L; L is before the final norm).
        layer_call(layer, *args): how each layer runs (runtime/compiled.py passes its compiled call, or
        fused.FusedLayers, which runs each layer as one C++ op). float_logits False: the logits in the head's
        dtype (a caller that converts them as it copies them: graphs.py).
        """
        x = self.model.embed_tokens(fb.input_ids)
        ropes = {t: (c[fb.positions].unsqueeze(2), s[fb.positions].unsqueeze(2))
                 for t, (c, s) in self.rope_tables(x.dtype).items()}
        masks = self.layer_masks(fb)
        hiddens = {}
        for i, layer in enumerate(self.model.layers):
            if i in hidden_layers:
                hiddens[i] = x
            cos, sin = ropes[self.cfg.layer_rope[i] if self.cfg.layer_rope else None]
            x = (layer_call or _call)(layer, x, cos, sin, k_cache[i], v_cache[i], fb, masks[i])
        if len(self.model.layers) in hidden_layers:  # the last layer's output, pre-norm (rollout/lossy's heads)
            hiddens[len(self.model.layers)] = x
        if logits_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_index]
        head = _head if float_logits else _head_in_dtype
        return (layer_call or _call)(head, self.model.norm, self.lm_head, x, self.cfg.final_softcap), hiddens

    def layer_masks(self, fb: ForwardBatch) -> list[AttnMask]:
        """Each layer's mask, built once per forward: fb.attn, or for sliding layers fb.attn with the window
        (dense: FlexAttention's block mask marks whole blocks full, which a window can cut, attention.dense_view).
        Attention soft-capping (Gemma 2) needs the scores, which only the dense kernel exposes: no FlexAttention.
        A window no position can reach (the RoPE table, which covers every position, is no longer) is dropped."""
        cfg, L = self.cfg, self.cfg.num_layers
        window = cfg.sliding_window if cfg.windows and cfg.sliding_window < self.rope_cos.shape[0] else None
        full = fb.attn
        if cfg.attn_softcap is not None and (full.block is not None or full.paged):
            full = dense_view(full, fb.positions)
        if window is None:
            return [full] * L
        slide = dense_view(fb.attn, fb.positions, window)
        return [slide if w else full for w in cfg.windows]


def _call(layer, *args):
    return layer(*args)


def _head(norm, lm_head, x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final norm, LM head, soft-cap (in the model dtype, as transformers) -> float32 logits; a function so
    that the compiled step compiles it too (its single-row product is the step's largest, compiled.py).
    A float32 head over a 16-bit body (TRL's cast_lm_head_to_fp32, loader.cast_head) takes the normed hidden
    state in float32, as TRL's patched head does."""
    return _head_in_dtype(norm, lm_head, x, cap).float()


def _head_in_dtype(norm, lm_head, x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """_head's logits in the head's dtype (forward's float_logits=False): a CUDA graph's copy into its float32
    buffer converts them as it copies (graphs.py), where a float32 copy of the full logits came between."""
    logits = normed(norm, lm_head, x) if x.dtype == lm_head.weight.dtype else lm_head(norm(x).to(lm_head.weight.dtype))
    if cap is not None:
        logits = softcap(logits, cap)
    return logits
