"""Reward functions with TRL's signature, `(completions, **kwargs) -> list[float | None]`, and a registry.

TRL calls each reward function with the decoded completions plus every dataset column as a keyword
list (ours: `answer`; TRL's own recipes: `solution`). Completions are conversational,
`[[{"role": "assistant", "content": "..."}], ...]`, or plain strings for plain-text prompts.

Why not `trl.rewards.accuracy_reward`: it reads the `solution` column and only accepts answers written
as LaTeX (`\\boxed{}` or `$...$`), so "7 + 5 = 12" scores 0 even though the value is right. Ours is
lenient about format and strict about value: it takes the first `\\boxed{}` if there is one, otherwise
the last number or expression in the text, and compares it to the gold answer with math_verify
(so "12", "12.0" and "\\boxed{12}" all match 12). The `format` reward is what pays for the box.
"""
from __future__ import annotations

import re
from collections.abc import Callable

_BOXED = re.compile(r"\\boxed\s*\{\s*[^\s}]")  # a \boxed{ that holds something (nesting allowed)


def _contents(completions: list) -> list[str]:
    """Text of each completion, conversational (a list of messages) or plain."""
    out = []
    for completion in completions:
        if isinstance(completion, str):
            out.append(completion)
        else:  # TRL's conversational form: one assistant message per completion
            out.append("".join(str(message.get("content") or "") for message in completion))
    return out


def accuracy_reward(completions: list, answer: list[str] | None = None, solution: list[str] | None = None,
                    **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold answer in value, else 0.0.

    The gold comes from the `answer` column (ours) or `solution` (TRL's). None for an example whose
    gold answer math_verify cannot parse: TRL then leaves that example out of the reward mean.
    """
    from math_verify import parse, verify

    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError("accuracy_reward needs the gold answers: the dataset must have an 'answer' (or 'solution') column")
    rewards: list[float | None] = []
    for text, gold_text in zip(_contents(completions), gold, strict=True):
        gold_parsed = parse(str(gold_text))
        if not gold_parsed:
            rewards.append(None)
            continue
        # math_verify's default extraction tries \boxed{} first, then LaTeX, then the last plain
        # expression/number: exactly "lenient about format".
        predicted = parse(text)
        rewards.append(float(bool(predicted) and verify(gold_parsed, predicted)))
    return rewards


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion puts an answer inside a non-empty \\boxed{}, else 0.0."""
    return [1.0 if _BOXED.search(text) else 0.0 for text in _contents(completions)]


REWARD_FUNCS: dict[str, Callable[..., list]] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
}


def get_reward_funcs(names: list[str] | tuple[str, ...] | str) -> list[Callable[..., list]]:
    """The reward functions named, in order (TRL logs each as rewards/<function name>/mean)."""
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in REWARD_FUNCS]
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}: valid names are {sorted(REWARD_FUNCS)}")
    if not names:
        raise ValueError(f"no reward functions named: pick at least one of {sorted(REWARD_FUNCS)}")
    return [REWARD_FUNCS[name] for name in names]


def score_completions(reward_funcs: list[Callable[..., list]], prompts: list, completions: list,
                      completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[list[float], dict[str, float]]:
    """Call each reward function as TRL's GRPOTrainer does and sum them per completion.

    Every function gets prompts, completions, completion_ids and each dataset column as keyword lists
    (one entry per completion). A None (no verdict) counts as 0 in the sum and is left out of that
    function's mean. Returns (total per completion, {"rewards/<name>/mean": ...}).
    """
    totals = [0.0] * len(completions)
    means: dict[str, float] = {}
    for func in reward_funcs:
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if len(values) != len(completions):
            raise ValueError(f"reward function {func.__name__} returned {len(values)} rewards for "
                             f"{len(completions)} completions")
        present = [float(v) for v in values if v is not None]
        means[f"rewards/{func.__name__}/mean"] = sum(present) / len(present) if present else float("nan")
        totals = [t + (float(v) if v is not None else 0.0) for t, v in zip(totals, values)]
    return totals, means
