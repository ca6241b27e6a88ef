"""The order `make test` runs the suite in (`-n 2 --dist worksteal`): the slow tests first, dealt to the workers.

xdist's worksteal scheduler hands worker i the i-th contiguous slice of the collected tests (the first N//2 to
one worker, the rest to the other) and lets an idle worker steal from the end of the other's queue. In file order
the slow tests bunched together: one worker ran 100 s tests at the end while the other had nothing left. Here
the slow units (rough seconds below, from `pytest --durations=0` runs) are dealt longest first to
the worker with the least so far, each at the head of its slice, and the remaining tests fill the slices in file
order; stealing then evens out the quick tail. A unit stays whole on one worker: the tests that start a local Ray
cluster (two clusters side by side overfill a 2-core machine, and each pool fixture is built once) and the
modules whose module-scoped fixture costs seconds. Without xdist (workers=1) the slow units simply come first.
"""
from __future__ import annotations

SMOKE = "tests/rlspec/test_bench.py::test_smoke_run_writes_its_report"
# unit name -> (estimated seconds, node-id prefixes)
UNITS = {
    "ray": (90, (f"{SMOKE}[workers]", "tests/rollout/workers/test_faults.py", "tests/rollout/workers/test_pool.py",
                 "tests/rollout/workers/test_drafter_health_pool.py")),
    **{f"smoke-{name}": (secs, (f"{SMOKE}[{name}]",)) for name, secs in (
        ("trl-suite", 20), ("chaos", 7), ("grpo", 5), ("passes", 5), ("lossy", 2), ("partial", 2), ("vllm", 1),
        ("ppo", 3), ("step", 3), ("drafter", 1), ("rollout-longtail", 1), ("rollout", 1))},
    **{path: (secs, (path,)) for path, secs in (
        ("tests/distributed/test_accelerate.py", 34), ("tests/rollout/speculation/test_trainer_process.py", 28),
        ("tests/test_bench_gpu.py", 42), ("tests/rollout/runtime/test_compiled.py", 45),
        ("tests/trainers/test_trl_compat.py", 10), ("tests/rollout/test_paging.py", 23),
        ("tests/rollout/speculation/test_law.py", 47), ("tests/rollout/runtime/test_kernels.py", 40),
        ("tests/rollout/runtime/test_kernel_build_lock.py", 11), ("tests/rlspec/test_train_cli.py", 12),
        ("tests/rollout/speculation/test_rsd.py", 7), ("tests/rollout/speculation/test_clean_exit.py", 17),
        ("tests/rollout/speculation/test_warm_start.py", 6), ("tests/rollout/speculation/test_eagle3.py", 11),
        ("tests/rollout/speculation/test_law_penalty.py", 11), ("tests/trainers/test_trl_tools.py", 2),
        ("tests/rlspec/test_resume_cli.py", 22), ("tests/rollout/speculation/test_state.py", 9),
        ("tests/trainers/test_backend_lost.py", 2), ("tests/trainers/test_ppo.py", 5),
        ("tests/trainers/test_grpo.py", 2), ("tests/trainers/test_partial_rollouts.py", 8),
        ("tests/trainers/test_partial_pool.py", 1), ("tests/rollout/test_partial_law.py", 9),
        ("tests/rollout/speculation/test_calibration_cache.py", 1),
        ("tests/rollout/runtime/test_graphs.py", 3), ("tests/test_wheel.py", 3), ("tests/rlspec/test_export.py", 1),
        ("tests/rlspec/test_vllm_export.py", 1), ("tests/rlspec/test_chaos_cluster.py", 30),
        ("tests/trainers/test_partial_resume.py", 4), ("tests/trainers/test_rloo_cli.py", 1),
        ("tests/rollout/runtime/test_paged_decode.py", 16), ("tests/rollout/runtime/test_kernels_engine.py", 19),
        ("tests/rollout/runtime/test_attention.py", 43), ("tests/rollout/runtime/test_kv_growth.py", 13),
        ("tests/rollout/runtime/test_triton_aot.py", 40))},
}


def unit_of(nodeid: str) -> str | None:
    return next((name for name, (_, prefixes) in UNITS.items() if nodeid.startswith(prefixes)), None)


def slice_sizes(n: int, workers: int) -> list[int]:
    """How many of n tests worksteal first hands each worker (xdist/scheduler/worksteal.py, check_schedule)."""
    sizes = []
    for i in range(workers):
        sizes.append(n // (workers - i))
        n -= sizes[-1]
    return sizes


def order(items: list, workers: int) -> list:
    """items reordered: per worker, its share of the slow units (longest first) and then quick tests in file order."""
    units: dict[str, list] = {}
    quick = []
    for item in items:
        name = unit_of(item.nodeid)
        (units.setdefault(name, []) if name else quick).append(item)
    lanes: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for name in sorted(units, key=lambda u: -UNITS[u][0]):  # longest first, to the least loaded worker
        j = load.index(min(load))
        lanes[j] += units[name]
        load[j] += UNITS[name][0]
    for lane, size in zip(lanes, slice_sizes(len(items), workers)):
        take = max(size - len(lane), 0)
        lane += quick[:take]
        del quick[:take]
    return [item for lane in lanes for item in lane] + quick
