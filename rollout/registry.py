"""One small registry class, used once per concept and every one declared at the bottom of this file: drafters
(what proposes tokens), selectors (which arm a decode step takes), strategies (the proposer + verifier pair a
decode step runs), rollout backends (what generates: the engine, a Ray pool, vLLM) and drafter losses (how the
online trainer distils the target into a learned drafter).

A name maps to a factory plus metadata (e.g. whether a drafter is learned). Built-in plug-ins are
listed here by name and module, so names validate without importing torch (config parsing stays
light); their modules register the factories on import, and `build` imports them on first use. A
plug-in of one's own registers with the decorator from any module imported before the engine is
built. Validation messages list every known name. This module imports nothing heavy.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    def __init__(self, concept: str, builtin: dict[str, str], unique: bool = False, hint: str = ""):
        self.concept = concept
        self._builtin = builtin  # name -> module that registers it
        self._factories: dict[str, Callable[..., Any]] = {}
        self._meta: dict[str, dict] = {}
        self._unique = unique  # a second registration of a name is an error (else the later one wins)
        self._hint = hint or f"a plug-in registers with @{concept.upper()}S.register(name)"

    def register(self, name: str, **meta):
        """Decorator: `@DRAFTERS.register("mine", learned=False)` above a factory or class."""
        def deco(factory):
            if self._unique and name in self._factories:
                raise ValueError(f"{self.concept} {name!r} is registered twice")
            self._factories[name] = factory
            self._meta[name] = meta
            return factory

        return deco

    def names(self) -> list[str]:
        return sorted(set(self._builtin) | set(self._factories))

    def check(self, name: str) -> None:
        """Raise a ValueError naming every registered choice when `name` is not one of them."""
        if name not in self._factories and name not in self._builtin:
            raise ValueError(f"unknown {self.concept} {name!r}; registered: {', '.join(self.names())} ({self._hint})")

    def _factory(self, name: str):
        self.check(name)
        if name not in self._factories:
            importlib.import_module(self._builtin[name])
        return self._factories[name]

    def meta(self, name: str) -> dict:
        self._factory(name)
        return self._meta[name]

    def build(self, name: str, *args, **kwargs):
        return self._factory(name)(*args, **kwargs)

    def get(self, name: str):
        """The registered factory (or function) itself."""
        return self._factory(name)

    # read as a mapping of name -> factory (importing every built-in module on iteration)
    def __contains__(self, name: object) -> bool:
        return name in self._factories or name in self._builtin

    def __iter__(self):
        return iter(self.names())

    def __getitem__(self, name: str):
        return self._factory(name)

    def items(self):
        return [(n, self._factory(n)) for n in self.names()]


# factory(target=..., spec=..., **overrides) -> Drafter; meta: learned (needs the target's hidden
# states), auto (part of drafter="auto")
DRAFTERS = Registry("drafter", {"ngram": "rlspec.rollout.speculation.drafters.ngram", "suffix": "rlspec.rollout.speculation.drafters.suffix",
                                "ngram_device": "rlspec.rollout.speculation.drafters.ngram_device",
                                "suffix_device": "rlspec.rollout.speculation.drafters.suffix_device",
                                "eagle3": "rlspec.rollout.speculation.drafters.eagle3"})
# factory(spec, drafter names (the first is the default), learned drafter names) -> Selector
SELECTORS = Registry("selector", {"fixed": "rlspec.rollout.speculation.selectors.fixed",
                                  "adaptive": "rlspec.rollout.speculation.selectors.adaptive",
                                  "always": "rlspec.rollout.speculation.selectors.always"})
# factory(spec, model, tokenizer, speculation) -> (Proposer, Verifier) (rollout/speculation/strategies.py): "exact"
# is lossless speculation, "lossy" the judge / step-routing pair; the engine takes "lossy" when SpecConfig.lossy
STRATEGIES = Registry("strategy", {"exact": "rlspec.rollout.speculation.strategies", "lossy": "rlspec.rollout.lossy.control"})
# factory(policy, tokenizer, spec, **engine_kwargs) -> RolloutBackend (rollout/backend.py registers all three;
# each imports its module, and Ray or vLLM, only when built)
BACKENDS = Registry("rollout backend", dict.fromkeys(("engine", "ray", "vllm"), "rlspec.rollout.backend"), unique=True,
                    hint="rollout.backend")
_LOSSES = "rlspec.rollout.speculation.training.distill_losses"
# fn(drafter logits, DraftTarget) -> (per-position loss, per-position weight) (distill_losses.py)
DRAFTER_LOSSES = Registry("drafter loss", dict.fromkeys(("ce", "kl", "tv", "tv_kl"), _LOSSES), unique=True,
                          hint="DrafterTrainer(loss=...)")
