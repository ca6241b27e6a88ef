"""The EAGLE-3 drafter network: one decoder layer over fused target features and token embeddings.

Layout and forward follow docs/export_format.md#forward, so an exported drafter loads in vLLM and SGLang:
  features = cat(target hidden states after HF layers aux_layer_ids)    [.., 3H]
  h        = fc(features)                    (later draft steps feed the drafter's own h instead)
  x        = cat(input_layernorm(embed(token)), hidden_norm(h))          [.., 2H]
  h'       = h + o_proj(attn(x));  out = h' + mlp(post_attention_layernorm(h'))
  logits   = lm_head(norm(out))  over the draft vocabulary; target id = draft id + d2t[draft id]
At position t the drafter sees the target's features of token t and the embedding of token t+1
and predicts token t+2. The token embedding is the target's own (shared, never trained here).

Attention is left to the caller (`attend(q, k, v)`): the engine attends over a KV cache, training
over whole windows with a training-time-test mask, so one network serves both.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlspec.rollout.runtime.model import fused_ops, llama
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.model.linear import fast_linear
from rlspec.rollout.runtime.model.fused_ops import rotate_pair
from rlspec.rollout.runtime.model.llama import RMSNorm, plus_product


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]  # HF hidden_states indices of the target's fused layers

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None) -> "Eagle3Config":
        L = target.num_layers
        # EAGLE-3's choice: a low, a middle and a high layer (HF indices 2, L//2, L-3), kept
        # distinct and inside the model for tiny test models.
        ids = sorted({min(max(i, 1), L - 1) for i in (2, L // 2, L - 3)})
        while len(ids) < 3:
            ids.append(ids[-1])
        return cls(target.hidden_size, target.intermediate_size, target.num_heads, target.num_kv_heads,
                   target.head_dim, target.rms_norm_eps, target.vocab_size,
                   min(draft_vocab_size or target.vocab_size, target.vocab_size), tuple(ids))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, nh, nkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, H, bias=False)


class Eagle3Model(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.cfg = c
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # target id = draft id + d2t[draft id]; identity until a draft vocabulary is chosen
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))

    @classmethod
    def initialised(cls, c: Eagle3Config, generator: torch.Generator) -> "Eagle3Model":
        """A fresh network whose random weights come from `generator`, not the global RNG: the same
        values torch.manual_seed(s) then Eagle3Model(c) gave (nn.Linear's default init, in module
        order) for a generator seeded with s."""
        with torch.device("meta"):
            model = cls(c)
        model.to_empty(device="cpu")
        done = {id(model.d2t)}
        with torch.no_grad():
            model.d2t.zero_()
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=generator)
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
                done |= {id(p) for p in m.parameters(recurse=False)} if isinstance(m, (nn.Linear, RMSNorm)) else set()
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in done]
        if left:  # a tensor added to the network without an init rule here would hold garbage
            raise RuntimeError(f"Eagle3Model.initialised has no init rule for {left}")
        return model

    def forward(self, hidden, embeds, cos, sin, attend) -> torch.Tensor:
        """hidden [B, T, 3H] target features (or [B, T, H] the drafter's previous output), embeds
        [B, T, H], cos/sin [B, T, 1, hd] (the target's tables: sin signed, rotary.rope);
        attend(q [B,nh,T,hd], k, v [B,nkv,T,hd]) -> [B, nh, T, hd].
        Returns the pre-norm output [B, T, H] (the next draft step's `hidden`)."""
        c, m = self.cfg, self.midlayer
        if hidden.shape[-1] != c.hidden_size:
            hidden = fast_linear(self.fc, hidden)
        B, T, _ = hidden.shape
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)
        q = fast_linear(m.self_attn.q_proj, x).view(B, T, c.num_heads, c.head_dim)
        k = fast_linear(m.self_attn.k_proj, x).view(B, T, c.num_kv_heads, c.head_dim)
        v = fast_linear(m.self_attn.v_proj, x).view(B, T, c.num_kv_heads, c.head_dim)
        q, k = (t.transpose(1, 2) for t in rotate_pair(q, k, cos, sin))
        out = attend(q, k, v.transpose(1, 2))
        h = plus_product(hidden, out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim), m.self_attn.o_proj,
                         fast_linear)
        gate, up = normed_products(m.post_attention_layernorm, (m.mlp.gate_proj, m.mlp.up_proj), h)
        return plus_product(h, F.silu(gate) * up, m.mlp.down_proj, fast_linear)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] float32 from the pre-norm output."""
        return normed_products(self.norm, (self.lm_head,), out)[0].float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab(self) -> torch.Tensor:
        """[Vd] long: the target id of each draft id, ascending (d2t changes with set_draft_vocab and new weights)."""
        return self.to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: the draft id of each target token, -1 where the draft vocabulary lacks it."""
        t2d = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        t2d[self.draft_vocab()] = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        return t2d

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Choose the draft vocabulary: target ids [Vd] (e.g. the most frequent tokens), sorted."""
        target_ids = target_ids.sort().values.to(self.d2t.device)
        self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=self.d2t.device))


def normed_products(norm: RMSNorm, linears: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """[fast_linear(linear, norm(x)) for each linear]. On CUDA outside autograd each may take the norm inside our
    few-rows product, where fused_ops measured that faster than the norm's kernel and the product apart
    (normed_product; products of one shape share the choice): the norm's kernel then goes from the level's graph.
    Those that take torch's share one norm(x)."""
    if not llama.fused_norm(x, norm.weight):
        y = norm(x)
        return [fast_linear(linear, y) for linear in linears]
    y = functools.cache(lambda: norm(x))
    return [fused_ops.normed_product(x, norm.weight, norm.eps, linear.weight, linear.bias,
                                     lambda linear=linear: fast_linear(linear, y())) for linear in linears]


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids given token counts [V]."""
    return counts.topk(size).indices.sort().values
