"""Validation of SpecConfig's lossy modes across fields: plain Python (no torch), run from SpecConfig.__post_init__
after each field's own rule (rollout/rules.py).

Every error says what is impossible and how to fix it. A model-dependent check (a draft model with
another tokenizer) happens where the model is loaded: rollout/lossy/draft_model.py.
"""
from __future__ import annotations

import os

DRAFT_MODEL_PREFIX = "draft_model="


def check_lossy(spec) -> None:
    """What depends on several fields (each field's own values are its rule's: rollout/types.py, rollout/rules.py)."""
    if spec.router == "learned" and not 0 <= spec.route_threshold <= 1:
        raise ValueError(f"route_threshold is a probability for router=learned: in [0, 1], got {spec.route_threshold}")
    if spec.router == "likelihood" and spec.route_threshold > 0:
        raise ValueError(f"route_threshold for router=likelihood is nats per token, <= 0 (0 keeps only steps the "
                         f"target finds at least as likely as its own typical token), got {spec.route_threshold}")
    lossy = spec.verification != "exact" or spec.step_routing != "off"
    if lossy and not spec.accept_off_policy:
        modes = [m for m, on in (("verification=judge", spec.verification == "judge"),
                                 ("step_routing=arbitrage", spec.step_routing == "arbitrage")) if on]
        raise ValueError(f"{' and '.join(modes)} is lossy: rollouts will hold tokens the policy would not have "
                         "sampled. Set accept_off_policy=true to opt in (and keep TRL's importance-sampling "
                         "correction on), or use verification=exact, step_routing=off for lossless rollouts")
    if spec.verification == "judge":
        if spec.drafter == "none":
            raise ValueError("verification=judge judges draft tokens, but drafter is 'none': pick a drafter "
                             "(e.g. drafter=suffix, eagle3 or auto)")
        if spec.tree_width != 1:
            raise ValueError(f"verification=judge works on chains: set tree_width=1 (got {spec.tree_width})")
    if spec.step_routing == "arbitrage":
        check_step_source(spec)


def check_step_source(spec) -> None:
    """step_source must name something that can write a step: a drafter of this engine or a local model."""
    src = spec.step_source
    if src is None:
        if spec.drafter == "none":
            raise ValueError("step_routing=arbitrage needs a draft source: set step_source (eagle3, suffix or "
                             "draft_model=<local dir>) or a drafter")
        return
    if src.startswith(DRAFT_MODEL_PREFIX):
        path = src[len(DRAFT_MODEL_PREFIX):]
        if not os.path.isdir(path):
            raise ValueError(f"step_source={src!r}: {path!r} is not a local directory; give a local HF model "
                             "directory with the target's tokenizer (e.g. draft_model=/models/qwen2.5-0.5b)")
        return
    if spec.drafter not in (src, "auto"):
        raise ValueError(f"step_source={src} uses the engine's {src} drafter, but drafter is {spec.drafter!r}: "
                         f"set drafter={src} or drafter=auto")
