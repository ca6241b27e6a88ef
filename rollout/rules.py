"""What values a config field allows: one `Rule` per field, declared next to the field and checked before torch
is imported. The one set of rules behind both the Python API (SpecConfig, SamplingParams: rollout/types.py) and the
CLI's run config (rlspec/config/sections.py, whose sections declare theirs the same way and whose loader runs the
rule of an overridden key so the error names the override).

A field declares its rule in its metadata (`field(..., metadata={"rule": AT_LEAST_1})`); `check_fields` runs them
from the dataclass's `__post_init__`. A value the type lets through but a run cannot use (a batch size of 0, a NaN
learning rate, a top_p of 0) is refused naming the field, the value and what is allowed. A `None` passes every
rule: whether a field may be null is its type's business. Plain Python only (no torch).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

SEED_MAX = 2**32 - 1  # numpy's seeds (transformers.set_seed, datasets' shuffle) are 32-bit unsigned


@dataclass(frozen=True)
class Rule:
    """A field's allowed values: `allowed` is what the error message says is allowed (a function when it
    is read at check time, e.g. a registry's names)."""

    allowed: str | Callable[[], str]
    test: Callable[[Any], bool]
    detail: Callable[[Any], str] | None = None  # what exactly is wrong with a refused value, if more is to say

    def text(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed

    def problem(self, value: Any) -> str | None:
        """None when `value` is allowed, else 'must be <allowed>, got <value>'."""
        if value is None:
            return None
        try:
            ok = bool(self.test(value))
        except (TypeError, ValueError, AttributeError):  # a value of the wrong type, built directly rather than loaded
            ok = False
        if ok:
            return None
        return f"must be {self.text()}, got {value!r}" + (f": {self.detail(value)}" if self.detail else "")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def at_least(n: int, why: str = "") -> Rule:
    return Rule(f">= {n}{f' ({why})' if why else ''}", lambda v: v >= n)


def closed(lo: float, hi: float, why: str = "") -> Rule:
    return Rule(f"in [{lo}, {hi}]{f' ({why})' if why else ''}", lambda v: _finite(v) and lo <= v <= hi)


AT_LEAST_1 = at_least(1)
AT_LEAST_0 = at_least(0)
POSITIVE = Rule("a finite number > 0", lambda v: _finite(v) and v > 0)
NON_NEGATIVE = Rule("a finite number >= 0", lambda v: _finite(v) and v >= 0)
FINITE = Rule("a finite number", _finite)
FRACTION = Rule("in (0, 1]", lambda v: _finite(v) and 0 < v <= 1)
UNIT = closed(0, 1)
STEPS = Rule("-1 (run num_train_epochs) or >= 1", lambda v: v == -1 or v >= 1)
SEED = Rule(f"in [0, {SEED_MAX}]", lambda v: 0 <= v <= SEED_MAX)
NON_EMPTY = Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))
DIRECTORY = Rule("an existing directory", lambda v: NON_EMPTY.test(v) and os.path.isdir(os.path.expanduser(v)))
DEVICE = Rule("a torch device such as cpu, cuda or cuda:1", lambda v: re.fullmatch(r"[a-z]+(:\d+)?", v) is not None)


def one_of(*choices: Any) -> Rule:
    """One of `choices`."""
    return Rule("one of " + ", ".join(repr(c) for c in choices), lambda v: v in choices)


def subset_of(choices: Iterable[str]) -> Rule:
    """A non-empty list drawn from `choices`."""
    names = tuple(choices)
    return Rule(f"a non-empty list drawn from {list(names)}", lambda v: bool(v) and all(x in names for x in v))


def registered(concept: str, names: Callable[[], Iterable[str]]) -> Rule:
    """A name from a registry, read when checked (a plug-in registered by then counts)."""
    return Rule(lambda: f"a registered {concept}: {', '.join(sorted(names()))}", lambda v: v in set(names()))


def names_list(concept: str, names: Callable[[], Iterable[str]]) -> Rule:
    """A non-empty list of distinct names from a registry read when checked; a refused list is explained
    by its first wrong name and the nearest valid one."""
    def ok(v: list) -> bool:
        return bool(v) and len(set(v)) == len(v) and set(v) <= set(names())

    def detail(v: list) -> str:
        for i, name in enumerate(v):
            if name not in set(names()):
                close = difflib.get_close_matches(str(name), sorted(names()), n=1, cutoff=0.5)
                return f"{name!r} is not one" + (f"; did you mean {close[0]!r}?" if close else "")
            if name in v[:i]:
                return f"{name!r} is named twice"
        return "name at least one"

    return Rule(lambda: f"a non-empty list of distinct {concept}: {', '.join(sorted(names()))}", ok, detail)


def field_rule(cls: Any, name: str) -> Rule | None:
    """The rule of field `name` of dataclass `cls`: its `rule` metadata, else the class's `RULES` entry
    (rules a subclass adds to fields it inherits, e.g. DrafterSection over SpecConfig)."""
    for f in dataclasses.fields(cls):
        if f.name == name and "rule" in f.metadata:
            return f.metadata["rule"]
    return getattr(cls, "RULES", {}).get(name)


def check_fields(obj: Any) -> None:
    """Raise ValueError('<field> must be <allowed>, got <value>') for the first field outside its rule;
    the loader prefixes the section's name and the config's source."""
    for f in dataclasses.fields(obj):
        rule = field_rule(type(obj), f.name)
        problem = rule.problem(getattr(obj, f.name)) if rule is not None else None
        if problem:
            raise ValueError(f"{f.name} {problem}")
