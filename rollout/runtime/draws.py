"""Per-sample random keys (generate(sample_keys=...)): every uniform that decides one of the target's tokens is a
hash of (sample key, position, purpose, index), so a sample's tokens depend on its key and the logits it is shown,
never on its batch mates, the batch size, preemption or a partial round's stop and carry
(docs/verification.md#per-sample-keys).

position is the sample's completion length when the draw is made (0 for the prefill's first token), purpose the
kind of draw (below), index its place among the draws of that kind in one step (a chain's draft j). A counter-based
hash, unlike a per-row torch.Generator, does not depend on how many draws the row (or any other) made before.

The hash runs on the engine's device in int64 torch ops, the same code on a CPU and a GPU: 32-bit words, each
multiply by an odd constant below 2**31 masked back to 32 bits, so no product reaches 2**63. `key_state` folds each
key into a 32-bit word once per call, `row_state` mixes in the position when a step binds its rows, `uniform` mixes
in (purpose, index): ~40 small ops a step on the device (docs/verification.md#per-sample-keys), none without keys.
"""
from __future__ import annotations

import copy
import math
import numbers

import torch

# purposes: the kinds of draw (the index says which one of its kind in a step)
FINAL = 0  # a token drawn from a distribution: a plain step, the prefill's first token, a chain's or tree's next
ACCEPT = 1  # a chain's acceptance test of draft j (index j)
TREE = 2  # a tree's acceptance test of child j at depth d (index d * W + j)
NODE = 3  # a deterministic chain's or tree's draw at position or node j (index j), matched against the drafts
DRAFT = 4  # a learned drafter's sampled draft at level d, branch j of W (index d * W + j)

KEY_LIMIT = 2**62  # keys are ints in [0, KEY_LIMIT)
_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x31848BAB  # odd and < 2**31: a 32-bit word times one stays below 2**63
_SALT = 0x9E3779B9  # so that key 0 does not start from mix32's fixed point 0
_INDEX_BITS = 24  # the draw word is purpose << 24 | index


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit words held in int64 (xorshift-multiply rounds, the shape of Wellons' lowbias32):
    every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def key_state(keys: torch.Tensor) -> torch.Tensor:
    """keys [S] int64 in [0, 2**62) -> [S] 32-bit words. Each 32-bit half goes in through an xor and a bijection, so
    with one half fixed, distinct values of the other give distinct words."""
    return mix32(mix32((keys & _MASK) ^ _SALT) ^ (keys >> 32))


def row_state(key_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """key_state words [R], positions [R] int64 -> [R] 32-bit words, one per (key, position) (for one key,
    distinct positions give distinct words)."""
    return mix32(key_states ^ (positions & _MASK))


def to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit words -> float32 in [0, 1) with 24 bits (exact in float32), so `1 - u` lies in (0, 1] as for
    torch.rand's."""
    return (h >> 8).to(torch.float32) * 2.0**-24


class KeyedDraws:
    """The keyed uniforms of one generate call (its keys, each folded once), bound to the rows of one draw site: pass
    it where a torch.Generator goes (rollout/runtime/sampling.py `uniform` tells the two apart).

    bind() before each step's draws (the engine's prefill and decode step do); each (purpose, index) may be drawn
    once per binding, so a draw site that took the same uniforms twice fails loudly instead of biasing the law."""

    def __init__(self, device: torch.device | str, keys: list[int]):
        self.device = torch.device(device)
        self._index = {k: i for i, k in enumerate(keys)}
        self._keys = key_state(torch.tensor(keys, dtype=torch.int64, device=self.device))  # [S]
        self.state: torch.Tensor | None = None  # [R] row states of the current binding
        self.offset = 0  # added to every index: a tree's depth (`shifted`)
        self._used: set[tuple[int, int]] = set()
        self._words: dict[tuple[int, int, int], torch.Tensor] = {}  # (purpose, offset, n) -> the draw words
        self.to_device = None  # the decode loop's funnel (runtime/transfers.py), given by the engine

    @property
    def rows(self) -> int:
        return 0 if self.state is None else self.state.shape[0]

    def bind(self, keys: list[int], positions: list[int], advance: torch.Tensor | None = None) -> "KeyedDraws":
        """The rows of the next draws: their keys (of this call's) and completion lengths (plus `advance` [R], on the
        device), one small host-to-device copy."""
        rows = [[self._index[k] for k in keys], positions]
        ids = self.to_device(rows) if self.to_device is not None else \
            torch.tensor(rows, dtype=torch.int64, device=self.device)
        at = ids[1] if advance is None else ids[1] + advance
        self.state, self.offset, self._used = row_state(self._keys[ids[0]], at), 0, set()
        return self

    def shifted(self, by: int) -> "KeyedDraws":
        """The same binding with every index moved on by `by` (a tree's depth d: by = d * W)."""
        out = copy.copy(self)  # shares state and the record of what was drawn
        out.offset = self.offset + by
        return out

    def uniform(self, shape: tuple[int, ...], purpose: int) -> torch.Tensor:
        """shape (rows, ...) float32 uniforms in [0, 1): row b's element i is H(key_b, position_b, purpose,
        offset + i), i running over the flattened trailing dims."""
        assert self.state is not None, "KeyedDraws.uniform before bind()"
        assert shape[0] == self.rows, f"a keyed draw of {shape[0]} rows from a binding of {self.rows}"
        n = math.prod(shape[1:])
        drawn = {(purpose, self.offset + i) for i in range(n)}
        assert not drawn & self._used, f"uniforms of purpose {purpose} drawn twice in one binding"
        assert self.offset + n <= 1 << _INDEX_BITS
        self._used |= drawn
        word = self._words.get((purpose, self.offset, n))
        if word is None:
            word = (purpose << _INDEX_BITS) | (self.offset + torch.arange(n, dtype=torch.int64, device=self.device))
            self._words[(purpose, self.offset, n)] = word = word[None, :]
        return to_uniform(mix32(self.state[:, None] ^ word)).reshape(shape)


def check_sample_keys(keys, count: int) -> list[int]:
    """generate()'s sample_keys: one int in [0, 2**62) per sequence, all distinct -> the keys as a list; a
    ValueError that says what is wrong otherwise."""
    keys = list(keys)
    where = "one per sequence, in result order (prompt-major: params.n per prompt; with partial=, each prompt's " \
            "listed samples)"
    if len(keys) != count:
        raise ValueError(f"sample_keys holds {len(keys)} keys for {count} sequences: give {where}")
    for i, k in enumerate(keys):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k < KEY_LIMIT:
            raise ValueError(f"sample_keys[{i}] is {k!r}: each key must be an int in [0, 2**62)")
    keys = [int(k) for k in keys]  # numpy's ints too
    if len(set(keys)) != len(keys):
        first: dict[int, int] = {}
        for i, k in enumerate(keys):
            if k in first:
                raise ValueError(f"sample_keys[{first[k]}] and sample_keys[{i}] are both {k}: two samples with "
                                 "one key would draw the same uniforms; give every sample its own key")
            first[k] = i
    return keys


def call_draws(gen: torch.Generator | None, sample_keys, seqs, params, device, to_device=None):
    """Where a generate call's target draws come from: `gen` (seeded by params.seed) without sample_keys, else a
    KeyedDraws, each sequence (in result order) holding its checked key. Greedy draws nothing: `gen`.
    to_device: the funnel a KeyedDraws binds its rows through (runtime/transfers.py)."""
    if sample_keys is None:
        return gen
    keys = check_sample_keys(sample_keys, len(seqs))
    for s, key in zip(seqs, keys):
        s.key = key
    if params.greedy:
        return gen
    draws = KeyedDraws(device, keys)
    draws.to_device = to_device
    return draws


def bound(draws, seqs, ahead: int = 0, advance: torch.Tensor | None = None):
    """The uniforms of one draw over these rows: keyed ones bound to the sequences' keys and completion lengths
    (the position: 0 for the prefill's first token; plus `ahead` for a step launched before the host has read the
    `ahead` plain steps in front of it, or plus `advance` [rows] on the device, the tokens the unread speculative step
    in front of it emits), or the call's generator as it is."""
    if not isinstance(draws, KeyedDraws):
        return draws
    return draws.bind([s.key for s in seqs], [len(s.completion_ids) + ahead for s in seqs], advance)
