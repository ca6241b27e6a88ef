"""Triton's JIT compiles in this process, counted through its compile hooks (`triton.knobs.runtime`).

The first launch of each variant of our kernels (a kernel, its constants and its arguments' alignments) compiles
it: about a second of the host's each (tests/rollout/runtime/triton_aot.py compiles 27 variants in ~23 s on one
core), paid by the section that meets it first. The report says how many each section compiled and what they
cost (`triton_compiles`), so a section that ran out of time can tell compiles from measurements, and each timed
call counts the compiles inside it (`timed_compiles` > 0: its seconds hold a compile, not a step's cost). A
variant another process already built is loaded from Triton's cache on disk, in milliseconds: it counts, but not
among those `built` (under LOAD_S; what the compile-ahead child of gpucheck/ahead.py saves the sections).

Inductor's kernels (FlexAttention's, a compiled layer's) are built through Triton's compiler directly, not through
its JIT, and are not counted. Nothing is counted where Triton is not installed, where its hooks are not there
(before 3.4), or in its interpreter (the CPU rehearsal), which compiles nothing."""
from __future__ import annotations

import time

LOAD_S = 0.1  # a "compile" shorter than this was a load from Triton's cache on disk (a build takes ~0.3 s or more)
LOG_PREFIX = "[triton compiled]"
_built = 0
_seconds = 0.0
_kernels: dict[str, int] = {}  # compiles per kernel (their sum: the count)
_started: list[float] = []  # the compile under way (compiles do not nest: one at a time per process)
_installed = False


def install(log: bool = False) -> bool:
    """Count this process's compiles from now on (once; the hooks already set are still called); log: print a
    line per compile (LOG_PREFIX, the kernel, its seconds), what a process that is killed leaves to count. Whether
    Triton's hooks are there to count through."""
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
        kernel = getattr(kw.get("fn"), "name", "?")
        seconds = finished(kernel)
        if log:
            print(f"{LOG_PREFIX} {kernel} {seconds:.3f}", flush=True)
        return after(**kw) if after else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    _installed = True
    return True


def finished(kernel: str) -> float:
    """One compile of `kernel` ended (what the post-compile hook records); its seconds."""
    global _built, _seconds
    seconds = time.perf_counter() - _started.pop() if _started else 0.0
    _built += seconds >= LOAD_S
    _seconds += seconds
    _kernels[kernel] = _kernels.get(kernel, 0) + 1
    return seconds


def logged(text: str) -> dict:
    """The compiles a log holds (the lines `install(log=True)` printed): how many, how many built, their seconds. A
    line cut off by the kill is not counted."""
    seconds = []
    for line in text.splitlines():
        fields = line[len(LOG_PREFIX):].split() if line.startswith(LOG_PREFIX) else []
        if len(fields) == 2 and fields[1].replace(".", "", 1).isdigit():
            seconds.append(float(fields[1]))
    return dict(count=len(seconds), built=sum(s >= LOAD_S for s in seconds), seconds=round(sum(seconds), 2))


def count() -> int:
    """Compiles so far in this process."""
    return sum(_kernels.values())


def mark() -> tuple[int, float, dict[str, int]]:
    """Where the counts stand now, for `since`."""
    return _built, _seconds, dict(_kernels)


def since(start: tuple[int, float, dict[str, int]]) -> dict:
    """Compiles since `start` (a `mark()`): how many, how many were built (not loaded from disk), their seconds
    and how many of each kernel; `counted` False where nothing could be counted (no hooks installed)."""
    built, secs, kernels = start
    new = {k: v - kernels.get(k, 0) for k, v in _kernels.items() if v != kernels.get(k, 0)}
    return dict(counted=_installed, count=sum(new.values()), built=_built - built, seconds=round(_seconds - secs, 2),
                kernels=new)
