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
    "ray": (230, (f"{SMOKE}[workers]", "tests/rollout/workers/test_faults.py", "tests/rollout/workers/test_pool.py",
                  "tests/rollout/workers/test_drafter_health_pool.py")),
    **{f"smoke-{name}": (secs, (f"{SMOKE}[{name}]",)) for name, secs in (
        ("trl-suite", 35), ("chaos", 14), ("grpo", 10), ("passes", 9), ("lossy", 5), ("partial", 4), ("vllm", 4),
        ("ppo", 4), ("step", 3), ("drafter", 2), ("rollout-longtail", 1), ("rollout", 1))},
    **{path: (secs, (path,)) for path, secs in (
        ("tests/distributed/test_accelerate.py", 62), ("tests/rollout/speculation/test_trainer_process.py", 60),
        ("tests/test_bench_gpu.py", 45), ("tests/rollout/runtime/test_compiled.py", 40),
        ("tests/trainers/test_trl_compat.py", 40), ("tests/rollout/test_paging.py", 40),
        ("tests/rollout/speculation/test_law.py", 40), ("tests/rollout/runtime/test_kernels.py", 30),
        ("tests/rollout/runtime/test_kernel_build_lock.py", 15), ("tests/rlspec/test_train_cli.py", 30),
        ("tests/rollout/speculation/test_rsd.py", 25), ("tests/rollout/speculation/test_clean_exit.py", 25),
        ("tests/rollout/speculation/test_warm_start.py", 20), ("tests/rollout/speculation/test_eagle3.py", 20),
        ("tests/rollout/speculation/test_law_penalty.py", 20), ("tests/trainers/test_trl_tools.py", 20),
        ("tests/rlspec/test_resume_cli.py", 20), ("tests/rollout/speculation/test_state.py", 15),
        ("tests/trainers/test_backend_lost.py", 15), ("tests/trainers/test_ppo.py", 15),
        ("tests/trainers/test_grpo.py", 15), ("tests/trainers/test_partial_rollouts.py", 55),
        ("tests/trainers/test_partial_pool.py", 20), ("tests/rollout/test_partial_law.py", 12),
        ("tests/rollout/speculation/test_calibration_cache.py", 10),
        ("tests/rollout/runtime/test_graphs.py", 10), ("tests/test_wheel.py", 8), ("tests/rlspec/test_export.py", 8),
        ("tests/rlspec/test_vllm_export.py", 5), ("tests/rlspec/test_chaos_cluster.py", 70),
        ("tests/trainers/test_partial_resume.py", 12), ("tests/trainers/test_rloo_cli.py", 10),
        ("tests/rollout/runtime/test_paged_decode.py", 15), ("tests/rollout/runtime/test_kernels_engine.py", 23))},
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
