"""Does online drafter training steal from rollouts or from the policy update? (issue 10, item 5)

Three measurements on the embedded SmolLM2-135M (CPU, bf16), every figure a median over --reps
repetitions taken in rotating order so machine noise spreads evenly:
  decode_threads   decode tokens/s at live batch 1, 2, 4 with 1 vs 2 torch threads: does the
                   tail of a rollout need both cores, or can the trainer have one?
  rollout          GRPO-shaped rollouts (P prompts x G samples, T=1, natural EOS) with the trainer
                   off / in a thread / in a process (nice 19, 1 thread) / a process at nice 0 /
                   a process while the engine decodes the tail with 1 thread. Decoding is plain
                   (the drafter's proposals are switched off, features are still captured and fed
                   to the trainer), and the same seed gives every mode the same tokens: the
                   slowdown is the trainer's interference alone. The trainer trains in the tail
                   and between rollouts; its buffer is filled by warm-up rollouts.
  policy_update    a policy-update-like fwd/bwd matmul workload (2 threads) while a trainer is idle
                   between rollouts (training), vs no trainer.

    python scripts/bench_trainer_overlap.py --out bench_out/trainer_overlap.json
    python scripts/bench_trainer_overlap.py --smoke      # tiny random model, seconds: checks it runs
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from common import math_prompts, parser, table, write_json
from bench_engine import rotation, timed_generate, tokenizer_and_eos
from longtail import phase_rates

MODES = ("off", "thread", "process", "process_nice0", "process_tail1")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny random model, few tokens, one repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="rollout: prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="rollout: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=192, help="rollout: cap per sample")
    p.add_argument("--decode-tokens", type=int, default=96, help="decode_threads: tokens per sample")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--out", default="bench_out/trainer_overlap.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.reps, args.prompts, args.group, args.max_new_tokens, args.decode_tokens = 1, 2, 4, 12, 8
        args.out = args.out.replace(".json", "_smoke.json")
    return args


class Setup:
    """The model, tokenizer and prompts: SmolLM2 (real run) or a tiny random Llama (--smoke)."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        if smoke:
            from tests.conftest import make_tiny_hf

            self.hf, self.tokenizer, self.eos = make_tiny_hf("llama", seed=0), None, [2]
        else:
            self.tokenizer, self.eos = tokenizer_and_eos("smollm2-135m-instruct")

    def engine(self, spec, rows: int):
        from rollout.engine import RolloutEngine
        from rollout.runtime.model import loader
        from rollout.runtime.model.fetch import fetch_model

        model = loader.from_hf_model(self.hf) if self.smoke else \
            loader.load_model(fetch_model("smollm2-135m-instruct"), dtype="bfloat16")
        return RolloutEngine(model, self.tokenizer, spec=spec, max_model_len=1024, max_num_seqs=rows,
                             eos_token_ids=self.eos)

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        if self.smoke:
            from tests.conftest import random_prompts

            return random_prompts(n, 3, 10, seed=seed)
        return math_prompts(self.tokenizer, n, seed=seed)


def decode_threads(setup: Setup, args) -> list[dict]:
    import torch

    from rollout.types import SamplingParams

    eng = setup.engine(None, 4)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.decode_tokens, seed=0, ignore_eos=True)
    eng.generate(setup.prompts(1, 7), params)  # warm-up
    runs = {(b, t): [] for b in (1, 2, 4) for t in (1, 2)}
    saved = torch.get_num_threads()
    for rep in range(args.reps):
        for b, t in rotation(list(runs), rep):
            torch.set_num_threads(t)
            eng.stats()
            eng.generate(setup.prompts(b, 50 + rep), params)
            trace = eng.batch_trace[1:]  # decode steps only (the first step follows the prefill)
            runs[(b, t)].append(sum(e for _, _, e, _ in trace) / max(trace[-1][0] - eng.batch_trace[0][0], 1e-9))
    torch.set_num_threads(saved)
    rows = []
    for b in (1, 2, 4):
        one, two = statistics.median(runs[(b, 1)]), statistics.median(runs[(b, 2)])
        rows.append({"batch": b, "tok_s_1_thread": one, "tok_s_2_threads": two, "speedup_2_over_1": two / one})
    return rows


def make_mode(setup: Setup, mode: str, rows: int, trainer_kwargs: dict):
    """An engine that decodes plainly but feeds a trainer placed as `mode` says."""
    import torch

    from rollout.speculation.drafter_training import DrafterTrainer
    from rollout.speculation.selectors.base import OFF
    from rollout.speculation.trainer_process import ProcessTrainer
    from rollout.types import SpecConfig

    eng = setup.engine(SpecConfig(drafter="eagle3", online_training=False), rows)
    eng.speculation.force(OFF)  # same tokens in every mode: only the trainer differs
    learned = eng.speculation.learned
    if mode == "thread":
        eng.speculation.attach_trainer(DrafterTrainer(learned, **trainer_kwargs)).start()
    elif mode.startswith("process"):
        nice = 0 if mode == "process_nice0" else 19
        eng.speculation.attach_trainer(ProcessTrainer(learned, threads=1, nice=nice, **trainer_kwargs))
    if mode == "process_tail1":  # what the engine could do: decode the tail with 1 thread, the trainer takes the other
        full = torch.get_num_threads()
        signal, generate = eng._signal_idle, eng.generate

        def tail_threads(idle: bool) -> None:
            if torch.get_num_threads() != (1 if idle else full):  # called every decode step
                torch.set_num_threads(1 if idle else full)
            signal(idle)

        def generate_then_restore(*a, **k):
            try:
                return generate(*a, **k)
            finally:
                torch.set_num_threads(full)

        eng._signal_idle, eng.generate = tail_threads, generate_then_restore
    return eng


def steps_of(eng) -> int:
    t = eng.speculation.trainer
    return 0 if t is None else t.stats.steps


def pause_others(engines: dict, keep: str | None) -> None:
    """Only the engine being measured may have a training trainer (idle) at a time."""
    for name, eng in engines.items():
        if name != keep:
            eng.speculation.set_idle(False)


def rollout(setup: Setup, args, engines: dict) -> list[dict]:
    from rollout.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group, seed=0)
    for name, eng in engines.items():  # warm-up rollouts fill every trainer's buffer
        pause_others(engines, name)
        for i in range(2):
            eng.generate(setup.prompts(args.prompts, 10 + i), params)
    results = {m: [] for m in engines}
    names = list(engines)
    for rep in range(args.reps):
        prompts = setup.prompts(args.prompts, 100 + rep)
        for name in rotation(names, rep):
            eng = engines[name]
            pause_others(engines, name)
            time.sleep(1.0)  # this trainer has trained between rollouts, as in a run; others are paused
            eng.stats()
            s0 = steps_of(eng)
            out, tok, wall = timed_generate(eng, prompts, params)
            steps = steps_of(eng) - s0  # a process's count lags by up to its snapshot period
            results[name].append({"tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall, "train_steps": steps,
                                  **phase_rates(eng.batch_trace, len(out))})
    rows = []
    for name, reps in results.items():
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        rows.append({"mode": name, **med, "tokens_per_s_reps": [round(r["tokens_per_s"], 1) for r in reps]})
    off = next((r for r in rows if r["mode"] == "off"), None)
    for r in rows:
        if off is not None:
            r["slowdown_pct"] = 100.0 * (off["tokens_per_s"] / r["tokens_per_s"] - 1.0)
        if off is not None and off["tail_tokens_per_s"] and r["tail_tokens_per_s"]:  # no tail: nothing to compare
            r["tail_slowdown_pct"] = 100.0 * (off["tail_tokens_per_s"] / r["tail_tokens_per_s"] - 1.0)
    return rows


def policy_update(args, engines: dict) -> list[dict]:
    """Seconds of a fwd/bwd MLP workload (2 threads) while one engine's trainer trains between rollouts."""
    import torch

    torch.manual_seed(0)
    width, batch, iters = (256, 64, 5) if args.smoke else (1536, 512, 12)
    mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-4)
    x = torch.randn(batch, width)

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            opt.zero_grad()
            mlp(x).pow(2).mean().backward()
            opt.step()
        return time.perf_counter() - t0

    work()
    conds = [m for m in engines if m in ("off", "thread", "process", "process_nice0")]
    runs = {m: [] for m in conds}
    for rep in range(args.reps):
        for name in rotation(conds, rep):
            pause_others(engines, name)
            engines[name].speculation.set_idle(True)  # between rollouts: the trainer may train
            time.sleep(1.0)
            s0 = steps_of(engines[name])
            secs = work()
            time.sleep(STATS_LAG_S)
            runs[name].append((secs, steps_of(engines[name]) - s0))
    base = statistics.median(s for s, _ in runs["off"]) if "off" in runs else None
    rows = []
    for name, rs in runs.items():
        secs = statistics.median(s for s, _ in rs)
        rows.append({"trainer": name, "seconds": secs, "train_steps_meanwhile": statistics.median(n for _, n in rs),
                     **({"slowdown_pct": 100.0 * (secs / base - 1.0)} if base else {})})
    pause_others(engines, None)
    return rows


STATS_LAG_S = 0.6  # a process trainer's metrics snapshot is at most 0.5 s old


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    load0 = os.getloadavg()
    setup = Setup(args.smoke)
    trainer_kwargs = {"min_tokens": 16} if args.smoke else {}
    t0 = time.time()
    threads = decode_threads(setup, args)
    print(table(threads, ["batch", "tok_s_1_thread", "tok_s_2_threads", "speedup_2_over_1"]))
    rows = args.prompts * args.group
    engines = {m: make_mode(setup, m, rows, trainer_kwargs) for m in args.modes}
    rollouts = rollout(setup, args, engines)
    print(table(rollouts, ["mode", "tokens_per_s", "slowdown_pct", "full_tokens_per_s", "tail_tokens_per_s",
                           "tail_slowdown_pct", "train_steps"]))
    update = policy_update(args, engines)
    print(table(update, ["trainer", "seconds", "slowdown_pct", "train_steps_meanwhile"]))
    for eng in engines.values():
        eng.close()
    write_json(args.out, {
        "config": {**vars(args), "model": "tiny-llama" if args.smoke else "smollm2-135m-instruct", "dtype": "bfloat16",
                   "cpus": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                   "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                   "loadavg_start": load0, "loadavg_end": os.getloadavg(), "seconds": time.time() - t0},
        "decode_threads": threads, "rollout": rollouts, "policy_update": update})


if __name__ == "__main__":
    main()
