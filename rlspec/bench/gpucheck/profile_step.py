"""Where a rollout's step time goes: one call under torch.profiler, summed per op.

Kept: what answers "host or device, and which kernels": the call's wall seconds, the device's busy seconds
(kernel time summed), the host-device synchronisations and copies counted, the kernels with the most device time,
the ops with the most host time, and per decode step the host gap (wall time the device was not busy)."""
from __future__ import annotations

import time

# calls that make the host wait for the device, or copy between them
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
            "aten::_local_scalar_dense", "aten::nonzero")


def profile_call(fn, device, top: int = 12, steps: int | None = None) -> dict:
    """Profile fn() once: wall_s, device_busy_s (CUDA kernels summed; 0 on a CPU), counts of SYNC_OPS, the `top`
    kernels by device time (name, calls, device_ms; none on a CPU), the `top` ops by self host time (name, calls,
    self_host_ms) and, given the call's decode steps, host_gap_ms_per_step: (wall - device busy) / steps."""
    from torch.profiler import ProfilerActivity, profile

    from rlspec.bench.gpucheck.common import sync

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    counts = {e.key: e.count for e in events if e.key in SYNC_OPS}
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    kernels = sorted((e for e in events if (getattr(e, "self_device_time_total", 0) or 0) > 0),
                     key=lambda e: e.self_device_time_total, reverse=True)[:top]
    out = dict(wall_s=wall, device_busy_s=device_us / 1e6, syncs=counts,
               top_kernels=[dict(name=e.key, calls=e.count, device_ms=e.self_device_time_total / 1e3) for e in kernels],
               top_host_ops=[dict(name=e.key, calls=e.count, self_host_ms=e.self_cpu_time_total / 1e3)
                             for e in ranked])
    if steps:
        out["decode_steps"] = steps
        out["host_gap_ms_per_step"] = (wall - device_us / 1e6) / steps * 1e3
    return out
