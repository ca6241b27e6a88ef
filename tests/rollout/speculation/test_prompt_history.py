"""The prompts' earlier rollouts the device n-gram drafter looks up (drafters/prompt_history.py): per prompt its newest
completions, prompts forgotten least recently used first, within their bounds, and a checkpoint's round trip."""
from __future__ import annotations

import pytest

from rlspec.rollout.speculation.drafters.prompt_history import PromptHistory


def texts(h: PromptHistory, prompt, limit=99):
    return [t.tolist() for t in h.texts(prompt, limit)]


def test_a_prompt_keeps_its_newest_completions_oldest_first():
    h = PromptHistory(per_prompt=2)
    for c in ([1], [2, 2], [3, 3, 3]):
        h.add([9, 9], c)
    assert texts(h, [9, 9]) == [[9, 9, 2, 2], [9, 9, 3, 3, 3]]
    assert texts(h, [9, 9], 1) == [[9, 9, 3, 3, 3]] and texts(h, [9, 9], 0) == []
    assert h.count([9, 9]) == 2 and h.count([9]) == 0 and texts(h, [8]) == []
    assert h.tokens == 2 + 2 + 3


def test_prompts_go_least_recently_used_first():
    h = PromptHistory(per_prompt=4, max_prompts=2)
    h.add([1], [5])
    h.add([2], [5])
    texts(h, [1])  # used: [2] is now the oldest
    h.add([3], [5])
    assert (h.count([1]), h.count([2]), h.count([3])) == (1, 0, 1)
    h = PromptHistory(per_prompt=4, max_tokens=7)  # by tokens: the newest prompt stays whatever its size
    h.add([1], [5, 5])
    h.add([2], [5, 5])
    assert (h.count([1]), h.count([2]), h.tokens) == (1, 1, 6)
    h.add([2], [6, 6])
    assert (h.count([1]), h.count([2]), h.tokens) == (0, 2, 5)
    h.add([3], list(range(20)))
    assert (h.count([2]), h.count([3]), h.tokens) == (0, 1, 21)


def test_off_and_bad_sizes():
    h = PromptHistory(per_prompt=0)
    h.add([1], [2])
    assert h.count([1]) == 0 and h.tokens == 0
    with pytest.raises(ValueError, match="history per prompt"):
        PromptHistory(per_prompt=-1)


def test_a_hash_collision_keeps_the_newer_prompt(monkeypatch):
    import rlspec.rollout.speculation.drafters.prompt_history as ph

    monkeypatch.setattr(ph, "hash", lambda key: 0, raising=False)  # every prompt in one place
    h = PromptHistory()
    h.add([1], [5])
    h.add([2], [6, 6])
    assert h.count([1]) == 0 and texts(h, [2]) == [[2, 6, 6]] and h.tokens == 3


def test_state_round_trip():
    h = PromptHistory(per_prompt=3)
    for p, c in [([1, 2], [3]), ([4], [5, 6]), ([1, 2], [7, 8, 9]), ([10], [])]:
        h.add(p, c)
    texts(h, [4])
    back = PromptHistory(per_prompt=3)
    back.load_state_dict(h.state_dict())
    assert back.state_dict()["counts"] == h.state_dict()["counts"] == [2, 1, 1]  # LRU order: [1, 2], [10], [4]
    assert back.tokens == h.tokens and all(texts(back, p) == texts(h, p) for p in ([1, 2], [4], [10]))
    back.load_state_dict({})  # a checkpoint from before the history
    assert back.tokens == 0 and back.count([4]) == 0
