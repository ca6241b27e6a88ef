"""Where a speculative rollout's step time goes: one call under torch.profiler, summed per op.

The oracle's rows run below the formula, by more the more drafts are rejected, on a GPU only (docs/gpu.md#the-
oracle-check-speculation-timed-on-a-gpu). This profiles one oracle call per acceptance and keeps what answers
"host or device, and which ops": the call's wall seconds, the device's busy seconds (kernel time summed), the
host-device synchronisations and copies counted, and the ops with the most host time."""
from __future__ import annotations

import time

# calls that make the host wait for the device, or copy between them
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
            "aten::_local_scalar_dense", "aten::nonzero")


def profile_call(fn, device, top: int = 12) -> dict:
    """Profile fn() once: wall_s, device_busy_s (CUDA kernels summed; 0 on a CPU), counts of SYNC_OPS, and the
    `top` ops by self host time (name, calls, self_host_ms)."""
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
    return dict(wall_s=wall, device_busy_s=device_us / 1e6, syncs=counts,
                top_host_ops=[dict(name=e.key, calls=e.count, self_host_ms=e.self_cpu_time_total / 1e3)
                              for e in ranked])
