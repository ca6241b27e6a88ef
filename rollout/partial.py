"""One generate() call as a round of partial rollouts (rollout/types.py PartialRound, docs/partial_rollouts.md).

The engine learns two things here: which sequences a round holds (a carried sample comes in holding its tokens,
as a preempted sequence comes back: `resumed`, so its prefix is prefilled again under the current weights and
its last token is fed at the next step; the fresh samples of a prompt form one group that shares the prompt's
prefill), and when the round is over. Carried samples are queued first: they are the oldest work, and finishing
them is what completes groups.
"""
from __future__ import annotations

from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.types import Carried, PartialRound, SamplingParams


def round_sequences(prompts: list[list[int]], partial: PartialRound, params: SamplingParams, max_model_len: int,
                    stop_ids: set[int]) -> tuple[list[Sequence], list[list[Sequence]], list[list[Sequence]]]:
    """(every sequence, in result order: prompt-major, each prompt's samples as given; the scheduler's groups;
    the sequences of each prompt)."""
    if len(partial.samples) != len(prompts):
        raise ValueError(f"a partial round lists samples for {len(partial.samples)} prompts, but {len(prompts)} "
                         "prompts were given")
    seqs, carried, fresh, by_prompt = [], [], [], []
    for i, (prompt, samples) in enumerate(zip(prompts, partial.samples)):
        cap = min(params.max_new_tokens, max_model_len - len(prompt))
        mine, new = [Sequence(i, j, list(prompt), cap) for j in range(len(samples))], []
        for s, c in zip(mine, samples):
            if c is None:
                new.append(s)
            else:  # a carried sample is a group of its own, prefilled alone
                _carry_in(s, c, stop_ids, i)
                carried.append([s])
        if new:
            fresh.append(new)
        by_prompt.append(mine)
        seqs.extend(mine)
    return seqs, carried + fresh, by_prompt


def round_over(partial: PartialRound, by_prompt: list[list[Sequence]], steps: int) -> bool:
    """The round has what it needs: enough complete groups, the groups it must finish, and at least its minimum
    of decode steps."""
    if steps < partial.min_decode_steps:
        return False
    if not all(s.finished for i in partial.must_finish for s in by_prompt[i]):
        return False
    return sum(all(s.finished for s in group) for group in by_prompt) >= partial.stop_after_groups


def _carry_in(s: Sequence, c: Carried, stop_ids: set[int], prompt: int) -> None:
    """s holds c's tokens and records and waits to be prefilled again (as a preempted sequence does)."""
    n = len(c.completion_ids)
    if n >= s.max_new_tokens:
        raise ValueError(f"a carried sample of prompt {prompt} holds {n} tokens, its whole budget of "
                         f"{s.max_new_tokens}: it is finished, not carried")
    if any(t in stop_ids for t in c.completion_ids):
        raise ValueError(f"a carried sample of prompt {prompt} holds a stop token: it is finished, not carried")
    s.completion_ids = list(c.completion_ids)
    s.logprobs = list(c.logprobs)
    s.behaviour_logprobs = list(c.behaviour_logprobs if c.behaviour_logprobs is not None else c.logprobs)
    s.token_source = list(c.token_source if c.token_source is not None else [0] * n)
    s.carried, s.resumed = n, True
