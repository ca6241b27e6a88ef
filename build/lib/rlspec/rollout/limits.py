"""The one prompt-length rule every backend and the trainers' preflight share.

A prompt fits a context of `max_model_len` tokens when it leaves room for at least `min_new_tokens`
generated tokens: len(prompt) + min_new_tokens <= max_model_len. The engine, the vLLM backend and
trainers/preflight.py all ask `check_prompt_lengths` and raise `prompt_too_long_error`, so a prompt
refused at step 100 by one of them is refused before step 1 by the preflight, with the same words.
"""
from __future__ import annotations

from collections.abc import Sequence

from rlspec.rollout.errors import PromptTooLongError

SHOWN = 10  # offending prompts named in one message; the count covers the rest


def fits(length: int, max_model_len: int, min_new_tokens: int = 1) -> bool:
    """Whether a prompt of `length` tokens leaves room for `min_new_tokens` new ones."""
    return length + min_new_tokens <= max_model_len


def check_prompt_lengths(prompts: Sequence[Sequence[int] | int], max_model_len: int,
                         min_new_tokens: int = 1) -> list[int]:
    """Indices of the prompts that do not fit. prompts: token id lists, or their lengths."""
    lengths = [p if isinstance(p, int) else len(p) for p in prompts]
    return [i for i, n in enumerate(lengths) if not fits(n, max_model_len, min_new_tokens)]


def prompt_too_long_error(offending: Sequence[tuple[int, int]], max_model_len: int, *, total: int | None = None,
                          where: str = "the engine's", min_new_tokens: int = 1,
                          fix: str = "or shorten the prompt") -> PromptTooLongError:
    """The error for prompts that do not fit. offending: (index, length) of each, in order; total: how many
    prompts were checked (named in the message when given); where: whose context ("the engine's", "vLLM's");
    fix: the remedy offered besides raising max_model_len."""
    shown = ", ".join(f"prompt {i} has {n} tokens" for i, n in offending[:SHOWN])
    more = f" (and {len(offending) - SHOWN} more)" if len(offending) > SHOWN else ""
    of = f" of {total}" if total is not None else ""
    room = "no room to generate" if min_new_tokens == 1 else f"no room for {min_new_tokens} new tokens"
    return PromptTooLongError(
        f"{len(offending)}{of} prompt(s) too long: {shown}{more} but {where} context is {max_model_len} tokens "
        f"(max_model_len), leaving {room}; raise max_model_len (rollout.max_model_len in a config) {fix}")


def check_request(prompts: Sequence[Sequence[int]], params, max_model_len: int, max_num_seqs: int, vocab: int) -> None:
    """What generate() refuses before any work: no prompt, more samples per prompt than rows, a prompt too long
    (the rule above), an empty prompt, a token id outside the vocabulary."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if params.n > max_num_seqs:
        raise ValueError(f"n={params.n} samples per prompt exceed max_num_seqs={max_num_seqs}; raise max_num_seqs")
    long = check_prompt_lengths(prompts, max_model_len)
    if long:
        raise prompt_too_long_error([(i, len(prompts[i])) for i in long], max_model_len, total=len(prompts))
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")
