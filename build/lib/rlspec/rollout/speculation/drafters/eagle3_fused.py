"""EAGLE-3's draft steps through the fused CPU layer op (kernels/decoder_layer.cpp, as the target's steps:
runtime/model/fused.py).

Why (docs/drafters.md#fused-draft-steps): a draft step is one small decoder layer, yet eagerly it is ~40 ops, most
of a drafted token's ~1.1 ms on this CPU went to Python and dispatch around 0.13 ms of products, and the target's
step had become ~8-11 ms (a drafted token cost ~10% of it). The op runs the layer in one call: q, k and v from
[norm(embedding) | norm(hidden)] (its `embeds` input), the drafter's KV layer in the paged pool, the products on
blocked copies of the drafter's weights (q|k|v and gate|up stacked: each output row is the same dot product as
its own matrix gives, so the same bits), and `final_head` gives the draft-vocabulary logits.

Chains only: a chain's draft keys go to the drafter's KV layer at the positions they stand for (cache_len
onwards, inside the room the step reserved for its drafts), where the next catch-up rewrites them before any
step reads them as context; the branches of a tree share those positions, so trees keep the eager step, whose
draft keys never leave the step. CPU, bf16, the kernels built, head sizes of whole 32-element steps.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.model import fused, kernels


class FusedDraftLayer:
    """The drafter network's layer and head as fused ops. `prepare` (once per proposal) remakes the blocked copies
    when a weight changed and gathers the ops' arguments, so that a step is one op call."""

    def __init__(self, model):
        self.model = model
        m = model.midlayer
        a, mlp = m.self_attn, m.mlp
        self._sources = {"qkv": (a.q_proj, a.k_proj, a.v_proj), "o": (a.o_proj,),
                         "gate_up": (mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj,), "lm_head": (model.lm_head,)}
        self._linears = [lin for group in self._sources.values() for lin in group]
        self._fits = fused.cpu_ready(model) and model.cfg.head_dim % 32 == 0  # the model's device and dtype stay
        self._key: tuple = ()
        self.layer_args: tuple = ()  # decoder_layer's, after its inputs
        self.chain_args: tuple = ()  # draft_chain's layer arguments (no biases, the embedding norm)
        self.head_args: tuple = ()

    @property
    def usable(self) -> bool:
        return fused.enabled and self._fits

    def prepare(self) -> "FusedDraftLayer":
        model, m, c = self.model, self.model.midlayer, self.model.cfg
        key = tuple((w._version, w.data_ptr()) for w in (lin.weight for lin in self._linears))
        if key != self._key:  # new weights (a trainer's, a checkpoint's): pack them again
            with torch.no_grad():
                w = {name: kernels.pack(torch.cat([lin.weight for lin in group]))
                     for name, group in self._sources.items()}
            shape = (c.num_heads, c.num_kv_heads, c.intermediate_size, c.rms_norm_eps, c.head_dim ** -0.5)
            self.chain_args = (m.hidden_norm.weight, w["qkv"], w["o"], m.post_attention_layernorm.weight, w["gate_up"],
                               w["down"], m.input_layernorm.weight, *shape)
            self.layer_args = (m.hidden_norm.weight, w["qkv"], None, w["o"], None, m.post_attention_layernorm.weight,
                               w["gate_up"], None, w["down"], None, *shape)
            self.head_args = (model.norm.weight, w["lm_head"], c.draft_vocab_size, c.rms_norm_eps)
            self._key = key
        self.embed_norm = m.input_layernorm.weight
        return self

    def step(self, h, embeds, cos, sin, k_pool, v_pool, slots, blocks, mask) -> torch.Tensor:
        """One draft step: h, embeds [R, T, H], cos/sin [R, T, 1, D], slots [R, T] where the keys go, blocks
        [R, n] and mask [R, 1, T, n * bs] what they attend -> the pre-norm output [R, T, H]."""
        return torch.ops.rlspec_kernels.decoder_layer(h, cos, sin, k_pool, v_pool, slots, blocks, mask,
                                                      *self.layer_args, embeds, self.embed_norm)

    def chain(self, h, embed, cos, sin, k_pool, v_pool, slots, blocks, masks, ids, r, temperature: float):
        """A whole chain after the catch-up as one op (kernels/draft_chain.cpp): draw 0 from h [R, H], then per
        draft step j (cos, sin [S, R, 1, 1, D], slots [S, R], masks [S, R, 1, 1, n * bs]) the layer on the last
        draw's embedding (embed: the target's table [V, H]) and a draw from its head. ids [Vd]: each draft id's
        target id; r [S + 1, R] uniforms (draws at 1 - r; unused at temperature 0, greedy). -> (target ids [R, S + 1],
        q [R, S + 1, V] over the target's vocabulary (empty when greedy), logits [R, S + 1, Vd], finite [R, S + 1])."""
        norm, lm_head, vocab, _ = self.head_args  # the layer's eps is the head's
        return torch.ops.rlspec_kernels.draft_chain(h, embed, cos, sin, k_pool, v_pool, slots, blocks, masks,
                                                    *self.chain_args, norm, lm_head, vocab, ids, r, temperature)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] float32 from the pre-norm output (Eagle3Model.logits)."""
        return torch.ops.rlspec_kernels.final_head(out, *self.head_args)
