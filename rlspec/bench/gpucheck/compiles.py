"""Triton's JIT compiles in this process, counted through its compile hooks (`triton.knobs.runtime`).

The first launch of each variant of our kernels (a kernel, its constants and its arguments' alignments) compiles
it: about a second of the host's each (tests/rollout/runtime/triton_aot.py compiles 27 variants in ~20 s on one
core), paid by the section that meets it first. The report says how many each section compiled and what they
cost (`triton_compiles`; a variant found in Triton's cache on disk counts too, at a few milliseconds), so a section that ran out of time can tell compiles from measurements, and each timed
call counts the compiles inside it (`timed_compiles` > 0: its seconds hold a compile, not a step's cost).

Nothing is counted where Triton is not installed, where its hooks are not there (before 3.4), or in its interpreter
(the CPU rehearsal), which compiles nothing."""
from __future__ import annotations

import time

_count = 0
_seconds = 0.0
_kernels: dict[str, int] = {}
_started: list[float] = []  # the compile under way (compiles do not nest: one at a time per process)
_installed = False


def install() -> bool:
    """Count this process's compiles from now on (once; the hooks already set are still called). Whether Triton's
    hooks are there to count through."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001 - no Triton (or one without knobs): nothing compiles through it to count
        return False
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_start(**kw):
        _started[:] = [time.perf_counter()]
        # a truthy answer would make Triton skip the compile: only the hook set before may give one
        return before(**kw) if before else None

    def on_end(**kw):
        finished(getattr(kw.get("fn"), "name", "?"))
        return after(**kw) if after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    _installed = True
    return True


def finished(kernel: str) -> None:
    """One compile of `kernel` ended (what the post-compile hook records)."""
    global _count, _seconds
    _count += 1
    if _started:
        _seconds += time.perf_counter() - _started.pop()
    _kernels[kernel] = _kernels.get(kernel, 0) + 1


def count() -> int:
    """Compiles so far in this process."""
    return _count


def mark() -> tuple[int, float, dict[str, int]]:
    """Where the counts stand now, for `since`."""
    return _count, _seconds, dict(_kernels)


def since(start: tuple[int, float, dict[str, int]]) -> dict:
    """Compiles since `start` (a `mark()`): how many, their seconds and how many of each kernel; `counted` False
    where nothing could be counted (no hooks installed)."""
    n, secs, kernels = start
    return dict(counted=_installed, count=_count - n, seconds=round(_seconds - secs, 2),
                kernels={k: v - kernels.get(k, 0) for k, v in _kernels.items() if v != kernels.get(k, 0)})
