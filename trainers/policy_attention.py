"""The policy's attention computed as its model defines it, so the trainer scores the law the engine samples.

Gemma 2 soft-caps its attention scores (config.attn_logit_softcapping: cap * tanh(score / cap)). Transformers'
SDPA path cannot, and the releases that run Gemma 2 on SDPA by default (5.17 among them) leave the cap out without
a word; later ones run Gemma 2 on eager attention only (its `_supports_sdpa` is False). The engine always applies
the cap. A policy left on SDPA would score the tokens the engine sampled under another law: TRL's importance
ratios away from 1 at step 1, and a KL to a reference that computes otherwise. `eager_where_capped` moves such a
policy and its reference to eager attention, as later transformers do, and says so.
"""
from __future__ import annotations

import warnings

IGNORES_SOFTCAP = ("sdpa",)  # transformers' attention paths that drop the cap (flash-attention and flex apply it)


def ignores_softcap(model) -> bool:
    """Whether transformers computes `model`'s attention without the soft-cap its config asks for."""
    config = getattr(model, "config", None)
    return (getattr(config, "attn_logit_softcapping", None) is not None
            and getattr(config, "_attn_implementation", None) in IGNORES_SOFTCAP)


def eager_where_capped(*models) -> int:
    """Move each model (a policy, its reference; None skipped; a DeepSpeed or DDP wrapper's module) whose
    attention would drop its soft-cap to transformers' eager attention. Returns how many moved."""
    moved = 0
    for model in models:
        model = getattr(model, "module", model)
        if model is not None and ignores_softcap(model):
            model.set_attn_implementation("eager")
            moved += 1
    if moved:
        warnings.warn("the policy soft-caps its attention scores (attn_logit_softcapping), which transformers' SDPA "
                      "attention leaves out; the rollout engine applies the cap, so the policy"
                      f"{' and its reference' if moved > 1 else ''} now run eager attention, which applies it too "
                      "(load the model with attn_implementation='eager' to say so yourself)", UserWarning,
                      stacklevel=3)
    return moved
