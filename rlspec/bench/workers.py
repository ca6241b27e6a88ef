"""Rollout workers on Ray: 2 workers x 1 thread vs 1 engine x 2 threads, spot drafter training on vs
off, GRPO with and without the pool, and the measured per-worker costs projected to 8 and 64 GPUs.

1. longtail: the embedded model, P math prompts x G samples at T=1 to EOS (long-tailed lengths), the
   same prompts for both sides each repetition: wall time, tokens/s, tail seconds (pool: from the
   first worker running out of tasks to the last result; engine: from the live batch falling to a
   quarter of its rows), tasks per worker.
2. spot: the pool with the eagle3 drafter (--drafter-path: a warm drafter, else a cold one) over
   --spot-steps rollouts of fresh prompts, online spot training on vs off: per step the rollout
   time, the tail's, eagle3's accepted length and the drafter version every worker holds.
3. grpo (--grpo-steps > 0): `python -m rlspec.train config=grpo_math.yaml` with rollout.workers=2
   vs the in-process engine, from each run's summary.json.
4. projection: the measured per-task decode cost, weight push and drafter sync, put into
   T(N) = work / N + longest task + push(N) + drafter sync(N) + queue(N) for N = 8 and 64 workers
   (one GPU each, as if a GPU worker cost what a CPU worker measured here), with where it breaks.

    python -m rlspec.bench drafter --save outputs/drafter_warm
    python -m rlspec.bench workers --drafter-path outputs/drafter_warm --grpo-steps 5
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from rlspec.bench import harness
from rlspec.bench.common import EMBEDDED, SMOKE_DTYPE, completion_tokens, hf_model, math_prompts, rollout_seconds, \
    smoke_model, timed_generate, train_run

NAME = "workers"
HELP = "Ray rollout workers vs one engine on the long tail, spot drafter training, projection to 8 and 64 GPUs"


def add_arguments(p) -> None:
    p.add_argument("--model", default=EMBEDDED)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--groups-per-task", type=int, default=2)
    p.add_argument("--spot-steps", type=int, default=6)
    p.add_argument("--drafter-path", default=None,
                   help="a warm EAGLE-3 drafter (`python -m rlspec.bench drafter --save DIR`)")
    p.add_argument("--spot-selector", default="always", help="always: eagle3 drafts at every step, so acceptance "
                                                             "is measured each step; fixed: only where it pays")
    p.add_argument("--grpo-steps", type=int, default=0, help="0 skips the GRPO runs")
    p.add_argument("--grpo-overrides", nargs="*", default=[])
    p.add_argument("--workdir", default="outputs/bench_workers")


def run(args) -> dict:
    import ray
    import torch

    from rlspec.rollout.types import SamplingParams
    from rlspec.rollout.workers.cluster import connect

    if args.smoke:
        args.prompts, args.group, args.max_new_tokens, args.reps, args.spot_steps = 2, 2, 8, 1, 1
        args.groups_per_task, args.grpo_steps, args.dtype = 1, 0, SMOKE_DTYPE
        args.model = smoke_model(args.model, args.out)
    connect(num_cpus=2)  # a loopback-only local cluster, no dashboard
    threads = torch.get_num_threads()  # longtail's engine arm sets 2: a caller in this process gets its own back
    try:
        tok, hf = hf_model(args.model, "float32")
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group, seed=args.seed)
        report = {"longtail": longtail(args, hf, tok, params)}
        report["spot"] = spot(args, hf, tok, params) if args.spot_steps > 0 else {}
        report["projection"] = project(report["longtail"], args)
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)
    report["grpo"] = grpo(args) if args.grpo_steps > 0 else {}
    print(json.dumps(report["projection"], indent=1))
    return {**report, "rows": report["longtail"]["rows"], "columns": ["config", "wall_s", "tokens", "tokens_per_s",
                                                                      "tail_s"]}


def plot(report: dict, path: str) -> None:
    spot_runs = report["spot"]
    series = {f"spot {k}: accept_len": [(s["step"], s["accept_len"]) for s in v] for k, v in spot_runs.items()}
    series.update({f"spot {k}: tail_s": [(s["step"], s["tail_s"]) for s in v] for k, v in spot_runs.items()})
    harness.line_plot(series, "rollout step", "accepted length / tail seconds", "spot drafter training on vs off", path)


QUEUE_S = 0.002  # driver work per task (ray.wait + submit + a hub poll): an assumption, not measured here


def longtail(args, hf, tok, params) -> dict:
    import torch

    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.workers.pool import RayPool

    kw = dict(max_model_len=args.max_model_len, max_num_seqs=args.prompts * args.group, dtype=args.dtype)
    pool = RayPool(hf, tok, None, workers=2, groups_per_task=args.groups_per_task, **kw)
    if not args.smoke:  # one engine on the two cores the pool's workers share; a smoke run keeps its caller's count
        torch.set_num_threads(2)
    engine = RolloutEngine.from_hf_model(hf, tok, **kw)
    warm = math_prompts(tok, 2, seed=8)
    pool.generate(warm, params), engine.generate(warm, params), pool.stats(), engine.stats()
    rows = {"pool 2x1": [], "engine 1x2": []}
    for rep in range(args.reps):
        prompts = math_prompts(tok, args.prompts, seed=100 + rep)
        t0 = time.perf_counter()
        out = pool.generate(prompts, params)
        s = pool.stats()
        rows["pool 2x1"].append(dict(wall_s=time.perf_counter() - t0, tokens=completion_tokens(out),
                                     tail_s=s["workers/tail_s"], busy_share=s["workers/busy_share"],
                                     tasks=(s["workers/tasks_min"], s["workers/tasks_max"])))
        out, tokens, wall = timed_generate(engine, prompts, params)
        trace = engine.batch_trace
        engine.stats()
        tail_at = next((t for t, live, _, _ in trace if live <= max(1, len(out) // 4)), wall)
        rows["engine 1x2"].append(dict(wall_s=wall, tokens=tokens, tail_s=wall - tail_at))
        print(f"[workers] rep {rep}: pool {rows['pool 2x1'][-1]['wall_s']:.1f} s, engine {wall:.1f} s", flush=True)
    costs = _costs(pool, hf, args)
    pool.close()
    summary = [{"config": k, **{m: sum(r[m] for r in v) for m in ("wall_s", "tokens", "tail_s")}}
               for k, v in rows.items()]
    for r in summary:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
    return {"rows": summary, "reps": rows, "costs": costs}


def _costs(pool, hf, args) -> dict:
    """Per-worker costs the projection scales: a weight push and a drafter-sized broadcast, timed here."""
    t0 = time.perf_counter()
    pool.load_weights(hf.state_dict().items())
    push = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    return {"weight_push_s": push, "weight_bytes": nbytes}


def spot(args, hf, tok, params) -> dict:
    from rlspec.rollout.types import SpecConfig
    from rlspec.rollout.workers.pool import RayPool

    out = {}
    # a smoke run starts the one pool with the hub (the costlier path: training, publishing); each pool is seconds of
    # worker start-up, and the off arm differs from it only in online_training
    for on in (True,) if args.smoke else (False, True):
        spec = SpecConfig(drafter="eagle3", drafter_path=args.drafter_path, online_training=on,
                          selector=args.spot_selector)
        pool = RayPool(hf, tok, spec, workers=2, groups_per_task=args.groups_per_task, drafter_trainer="spot",
                       max_model_len=args.max_model_len, max_num_seqs=args.prompts * args.group, dtype=args.dtype)
        steps = []
        for step in range(args.spot_steps):
            t0 = time.perf_counter()
            pool.generate(math_prompts(tok, args.prompts, seed=500 + step), params)
            s = pool.stats()
            steps.append(dict(step=step, rollout_s=time.perf_counter() - t0, tail_s=s["workers/tail_s"],
                              accept_len=s.get("rollout/accept_len/eagle3", 1.0),
                              drafter_version=s.get("drafter/worker_version_min", 0.0),
                              train_steps=s.get("drafter/train_steps", 0.0)))
            print(f"[workers] spot {'on' if on else 'off'} step {step}: {steps[-1]}", flush=True)
        pool.close()
        out["on" if on else "off"] = steps
    return out


def grpo(args) -> dict:
    runs = {}
    for label, extra in (("engine", []), ("ray x2", ["rollout.workers=2"])):
        s = train_run("bench workers", Path(args.workdir) / label.replace(" ", "_"), "grpo_math.yaml",
                      args.grpo_steps, ["grpo.save_steps=1000", *extra, *args.grpo_overrides])
        runs[label] = {"wall_s": s["wall_s"], "tokens_per_s": s["tokens_per_s"], "rollout_s": rollout_seconds(s)}
    return runs


def project(lt: dict, args) -> dict:
    """T(N) from the measured pool run (see the module docstring; docs/workers.md#projection)."""
    pool = lt["reps"]["pool 2x1"]
    work = sum(r["wall_s"] * r["busy_share"] * 2 for r in pool) / len(pool)  # worker-seconds per step
    tasks = -(-args.prompts // args.groups_per_task)
    longest = sum(r["tail_s"] for r in pool) / len(pool) + work / tasks  # a task that starts last runs alone
    c = lt["costs"]
    out = {"model": "T(N) = max(work/N, longest task) + push + drafter + tasks*queue; push and drafter sync "
                     "grow with the nodes that pull the object (owner bandwidth), queue is the driver's per-task cost",
           "work_worker_s": work, "tasks_per_step": tasks, "longest_task_s": longest,
           "assumed": {"queue_s_per_task": QUEUE_S, "gpus_per_node": 8}}
    for n in (8, 64):
        nodes = max(1, n // 8)  # 8 GPUs a node: the object store pulls once per node
        push = c["weight_push_s"] * nodes
        queue = tasks * QUEUE_S
        t = max(work / n, longest) + push + queue
        breaks = []
        if n > tasks:
            breaks.append(f"queue: {tasks} tasks for {n} workers: {n - tasks} idle (lower groups_per_task)")
        if work / n < longest:
            breaks.append("tail: the longest task outlasts work/N; more workers do not shorten the step")
        if push > 0.1 * t:
            breaks.append("weight broadcast: over 10% of the step (broadcast tree / NCCL needed)")
        out[f"N={n}"] = {"step_s": t, "speedup_vs_1": (work + c["weight_push_s"]) / t, "push_s": push,
                         "queue_s": queue, "breaks": breaks}
    return out
