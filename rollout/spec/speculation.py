"""Speculation setup: which drafters run, which selector picks the arm, and one object for their hooks.

`SpecConfig.drafter` names one drafter, or "auto" for all of them (suffix, n-gram and the learned
EAGLE-3 one); `SpecConfig.selector` is "fixed" (the long-tail policy over the configured shape) or
"adaptive" (a bandit over drafters and shapes per batch size). The engine talks to a `DrafterSet`:
bookkeeping hooks reach every drafter, a proposal goes to the drafter the chosen arm names, and the
learned drafter (if any) also receives the target's hidden states.
"""
from __future__ import annotations

from rollout.spec.drafters.base import Draft, Drafter, make_drafter
from rollout.spec.selectors.longtail import Arm, LongTailSelector
from rollout.types import SpecConfig

AUTO_DRAFTERS = ("suffix", "ngram", "eagle3")


class DrafterSet:
    def __init__(self, drafters: dict[str, Drafter]):
        self.by_name = drafters
        # at most one learned drafter: it needs the target's features and a KV layer of its own
        self.learned = next((d for d in drafters.values() if hasattr(d, "aux_layers")), None)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.learned.aux_layers) if self.learned is not None else ()

    @property
    def extra_kv_layers(self) -> int:
        return getattr(self.learned, "extra_kv_layers", 0)

    @property
    def trainer(self):
        """The learned drafter's online trainer, if one is attached."""
        return getattr(self.learned, "source", None)

    def version(self) -> int:
        return getattr(self.learned, "version", 0)

    def propose(self, arm: Arm, seqs, caps: list[int]) -> list[Draft]:
        drafter = self.by_name[arm.drafter]
        if hasattr(drafter, "stop_rule"):
            drafter.stop_rule = arm.stop
        return drafter.propose(seqs, caps, arm.width)

    def begin(self, groups) -> None:
        for d in self.by_name.values():
            d.begin(groups)

    def finish(self, seq) -> None:
        for d in self.by_name.values():
            d.finish(seq)

    def set_policy_version(self, version: int) -> None:
        if self.learned is not None:
            self.learned.policy_version = version  # tags the learned drafter's training data


def build_speculation(spec: SpecConfig, target, custom: Drafter | None = None):
    """-> (DrafterSet, selector), or (None, None) without speculation."""
    if not spec.enabled and custom is None:
        return None, None
    if custom is not None:
        drafters = {getattr(custom, "name", spec.drafter): custom}
    else:
        names = AUTO_DRAFTERS if spec.drafter == "auto" else (spec.drafter,)
        drafters = {n: make_eagle3(spec, target) if n == "eagle3" else make_drafter(n) for n in names}
    dset = DrafterSet(drafters)
    if spec.selector == "adaptive" or spec.drafter == "auto":
        from rollout.spec.selectors.bandit import AdaptiveSelector, default_arms

        widths = (spec.tree_width,) if spec.tree_width > 1 else (2, 3)
        arms = default_arms(dset.names, max_depth=spec.num_draft_tokens, widths=widths)
        # exploring a losing arm at a large batch costs up to ~2x a plain step on CPU (bench_out/
        # longtail.json: 10% exploration made the bandit 7% slower than plain decoding), so the
        # engine explores at most 3% of steps; the class default stays general
        return dset, AdaptiveSelector(arms, max_spec_batch=spec.max_spec_batch, explore_cap=0.03)
    name = dset.names[0]
    return dset, LongTailSelector(name, spec.num_draft_tokens, spec.tree_width, spec.max_spec_batch)


def make_eagle3(spec: SpecConfig, target):
    from rollout.spec.drafters.eagle3 import Eagle3Drafter

    if spec.drafter_path:
        from rollout.spec.drafters.eagle3_io import load_eagle3

        drafter = Eagle3Drafter(target, load_eagle3(spec.drafter_path))
    else:  # cold: only online training makes it useful; the selector keeps it off until it pays
        drafter = Eagle3Drafter(target, draft_vocab_size=spec.draft_vocab_size)
    if spec.online_training:
        from rollout.spec.drafter_training import DrafterTrainer

        DrafterTrainer(drafter).start()  # attaches itself as the drafter's data sink and weight source
    return drafter
