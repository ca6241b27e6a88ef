"""A prompt's earlier rollouts, kept on the host between generate calls for the device n-gram lookup (ngram_device.py).

A GRPO run samples each prompt again every epoch, and the best evidence for how a sample goes on is how the same
prompt's earlier samples went on (the suffix drafter's history, suffix.py). This store keeps, per prompt, its last
`per_prompt` finished completions as raw token arrays (4 bytes a token: no index, the device lookup needs none),
with prompts forgotten least recently used first past `max_prompts` or `max_tokens` held.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict, deque

from rlspec.rollout.speculation.checkpoint import pack_arrays, unpack_arrays


class PromptHistory:
    def __init__(self, per_prompt: int = 8, max_prompts: int = 4096, max_tokens: int = 4_194_304):
        if per_prompt < 0:
            raise ValueError(f"history per prompt must be >= 0, got {per_prompt}")
        self.per_prompt, self.max_prompts, self.max_tokens = per_prompt, max_prompts, max_tokens
        # hash(prompt) -> [prompt tokens, deque of completions, oldest first]; least recently used first
        self._prompts: OrderedDict[int, list] = OrderedDict()
        self.tokens = 0  # prompts' and completions' tokens held

    def add(self, prompt: list[int], completion: list[int]) -> None:
        """A sample of `prompt` finished with `completion`: the newest of its prompt's history."""
        if not self.per_prompt:
            return
        entry = self._entry(prompt, create=True)
        entry[1].append(array("i", completion))
        self.tokens += len(completion)
        while len(entry[1]) > self.per_prompt:
            self.tokens -= len(entry[1].popleft())
        self._trim()

    def texts(self, prompt: list[int], limit: int) -> list[array]:
        """The prompt's last `limit` completions, each behind the prompt (prompt + completion), oldest first."""
        entry = self._entry(prompt) if limit > 0 else None
        if entry is None:
            return []
        return [entry[0] + c for c in list(entry[1])[-limit:]]

    def count(self, prompt: list[int]) -> int:
        """How many completions of the prompt are held (no use: its place in the LRU order stays)."""
        entry = self._prompts.get(hash(tuple(prompt)))
        return len(entry[1]) if entry is not None and entry[0].tolist() == prompt else 0

    def state_dict(self) -> dict:
        """Every held prompt (LRU order) with its completions (oldest first), packed (checkpoint.py)."""
        docs, counts = [], []
        for prompt, comps in self._prompts.values():
            docs += [prompt, *comps]
            counts.append(len(comps))
        return {"counts": counts, "docs": pack_arrays(docs)}

    def load_state_dict(self, state: dict) -> None:
        self._prompts, self.tokens = OrderedDict(), 0
        if not state:  # a checkpoint from before the history: nothing held
            return
        docs = iter(unpack_arrays(state["docs"]))
        for n in state["counts"]:
            prompt = next(docs)
            comps = deque(next(docs) for _ in range(n))
            self._prompts[hash(tuple(prompt))] = [prompt, comps]
            self.tokens += len(prompt) + sum(map(len, comps))

    def _entry(self, prompt: list[int], create: bool = False) -> list | None:
        key = hash(tuple(prompt))
        entry = self._prompts.get(key)
        if entry is not None and entry[0].tolist() != prompt:  # a hash collision: the newer prompt takes the place
            self.tokens -= len(entry[0]) + sum(map(len, entry[1]))
            del self._prompts[key]
            entry = None
        if entry is None:
            if not create:
                return None
            entry = self._prompts[key] = [array("i", prompt), deque()]
            self.tokens += len(prompt)
        self._prompts.move_to_end(key)
        return entry

    def _trim(self) -> None:
        while len(self._prompts) > 1 and (len(self._prompts) > self.max_prompts or self.tokens > self.max_tokens):
            prompt, comps = self._prompts.popitem(last=False)[1]
            self.tokens -= len(prompt) + sum(map(len, comps))
