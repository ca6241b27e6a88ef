"""Memory bounds of our Triton kernels, checked where they run through Triton's interpreter (no GPU).

On a GPU a load or store past a tensor faults at best (a sticky CUDA error: the process, and every kernel after it,
is lost, which no fallback of ours can catch) and at worst reads or overwrites a neighbour in the caching
allocator's segment without a word. The interpreter reads and writes host memory at the same addresses and checks
nothing. `install()` makes it check: every load and store a kernel launch makes, where its mask is on, must lie
inside one of the tensors passed to that launch (the span from a view's lowest to its highest element; views of one
tensor merged), or it raises before touching memory and is recorded in `violations`. tests/conftest.py installs it
for the whole suite and fails the test that recorded one (our kernels' fallbacks would otherwise turn the error
into a warning and the torch ops' result)."""
from __future__ import annotations

import numpy as np
import torch

violations: list[str] = []  # one line per out-of-bounds access since the last `take()`
checked = [0]  # loads and stores checked (a test of the checker asserts it looked)
_spans: list[np.ndarray] = []  # the running launch's allowed byte spans [lo, hi), sorted and merged: [n, 2] uint64


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """[lo, hi) in bytes of the elements a view reaches (None: no element)."""
    if t.numel() == 0:
        return None
    lo = sum(min(0, st * (n - 1)) for n, st in zip(t.shape, t.stride()))
    hi = sum(max(0, st * (n - 1)) for n, st in zip(t.shape, t.stride()))
    size = t.element_size()
    return t.data_ptr() + lo * size, t.data_ptr() + (hi + 1) * size


def merged(spans: list[tuple[int, int]]) -> np.ndarray:
    """Overlapping spans joined, sorted by start: [n, 2] uint64."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return np.array(out, dtype=np.uint64).reshape(-1, 2)


def outside(ptrs: np.ndarray, mask: np.ndarray, size: int, spans: np.ndarray) -> np.ndarray:
    """The addresses of ptrs (uint64) under mask whose `size` bytes do not lie inside one of spans."""
    shape = np.broadcast_shapes(np.shape(ptrs), np.shape(mask))
    p = np.broadcast_to(ptrs, shape)[np.broadcast_to(mask, shape)].astype(np.uint64)
    if len(spans) == 0:
        return p
    i = np.searchsorted(spans[:, 0], p, side="right").astype(np.int64) - 1
    ok = (i >= 0) & (p + np.uint64(size) <= spans[np.maximum(i, 0), 1])
    return p[~ok]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def install() -> None:
    """Patch Triton's interpreter (idempotent): launches record their tensors' spans, masked loads and stores check
    their addresses against them."""
    from triton.runtime import interpreter as ti

    if getattr(ti.GridExecutor, "_bounds_checked", False):
        return
    init_args, load, store = ti.GridExecutor._init_args_hst, ti.InterpreterBuilder.create_masked_load, \
        ti.InterpreterBuilder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        found = [span(t) for t in _tensors([*args_hst, *kwargs_hst.values()])]
        _spans[:] = [merged([s for s in found if s is not None])]
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        if not _spans:
            return
        checked[0] += 1
        size = np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize
        bad = outside(ptrs.data, mask.data, size, _spans[0])
        if len(bad):
            line = (f"{what} of {len(bad)} element(s) outside every tensor of the launch, first at "
                    f"{int(bad[0]):#x} (allowed spans: {[(hex(int(a)), hex(int(b))) for a, b in _spans[0]]})")
            violations.append(line)
            raise IndexError(line)

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "a load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        check(ptrs, mask, "a store")
        return store(self, ptrs, value, mask, cache_policy)

    ti.GridExecutor._init_args_hst = init_args_hst
    ti.InterpreterBuilder.create_masked_load = masked_load
    ti.InterpreterBuilder.create_masked_store = masked_store
    ti.GridExecutor._bounds_checked = True


def take() -> list[str]:
    """The violations recorded since the last take, cleared."""
    out = violations[:]
    violations.clear()
    return out
