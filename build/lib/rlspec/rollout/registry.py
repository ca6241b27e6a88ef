"""One small registry class, used once per concept: drafters (what proposes tokens), selectors (which arm
a decode step takes) and strategies (the proposer + verifier pair a decode step runs).

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
    def __init__(self, concept: str, builtin: dict[str, str]):
        self.concept = concept
        self._builtin = builtin  # name -> module that registers it
        self._factories: dict[str, Callable[..., Any]] = {}
        self._meta: dict[str, dict] = {}

    def register(self, name: str, **meta):
        """Decorator: `@DRAFTERS.register("mine", learned=False)` above a factory or class."""
        def deco(factory):
            self._factories[name] = factory
            self._meta[name] = meta
            return factory

        return deco

    def names(self) -> list[str]:
        return sorted(set(self._builtin) | set(self._factories))

    def check(self, name: str) -> None:
        """Raise a ValueError naming every registered choice when `name` is not one of them."""
        if name not in self._factories and name not in self._builtin:
            raise ValueError(f"unknown {self.concept} {name!r}; registered: {', '.join(self.names())} "
                             f"(a plug-in registers with @{self.concept.upper()}S.register(name))")

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


# factory(target=..., spec=..., **overrides) -> Drafter; meta: learned (needs the target's hidden
# states), auto (part of drafter="auto")
DRAFTERS = Registry("drafter", {"ngram": "rlspec.rollout.speculation.drafters.ngram", "suffix": "rlspec.rollout.speculation.drafters.suffix",
                                "eagle3": "rlspec.rollout.speculation.drafters.eagle3"})
# factory(spec, drafter names (the first is the default), learned drafter names) -> Selector
SELECTORS = Registry("selector", {"fixed": "rlspec.rollout.speculation.selectors.longtail", "adaptive": "rlspec.rollout.speculation.selectors.bandit",
                                  "always": "rlspec.rollout.speculation.selectors.forced"})
# factory(spec, model, tokenizer, speculation) -> (Proposer, Verifier) (rollout/speculation/strategies.py): "exact"
# is lossless speculation, "lossy" the judge / step-routing pair; the engine takes "lossy" when SpecConfig.lossy
STRATEGIES = Registry("strategy", {"exact": "rlspec.rollout.speculation.strategies", "lossy": "rlspec.rollout.lossy.control"})
