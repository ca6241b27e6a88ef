"""Host work per decode step: what a GPU waits for when nothing overlaps.

A tiny random Llama (1 layer, hidden 32, vocab 64) whose forward costs next to nothing, on the CPU, decoded through
the public API (`generate`, EOS ignored) plainly, with a 4-token n-gram chain, with an n-gram tree, with a 4-token
suffix chain (the GRPO recipes' drafter: siblings and earlier rollouts), with a 4-token n-gram chain looked up on the
device (`ngram_device`), with suffix's chains and the device lookup's for the rows suffix leaves empty
(`suffix_device`), with a 4-token chain from an EAGLE-3 drafter (selector "always") and plainly beside that drafter
(`eagle3_plain`: every step plain, the drafter's features staged), at each batch size. The EAGLE-3 drafter runs its
CUDA path's graph bookkeeping with emulated graphs (`graph_mode="emulate"`), and so does the device n-gram drafter's
lookup: what a GPU replays as one graph launch is here a call of its closure, timed as device work. Per (mode, batch):

  * ms_per_step: (t(long call) - t(short call)) / (steps(long) - steps(short)), so prefill and call set-up cancel;
  * forward_ms: the device's work per step, timed the same way: the target forward (ModelRunner.step) and the
    drafter's graphs; host_ms = the rest: scheduling, drafting outside graphs, verification, the host transfer and
    the commit;
  * exposed_ms: the median time from a step's read of its one host transfer to the next device work (the next
    step's forward, or a drafter's first graph of the next proposal): what a GPU idles through between two
    steps when the host reads a step before it launches the next (as here, every step: on CUDA plain steps and
    chains drafted on the device, `ngram_device`'s and EAGLE-3's, look ahead instead, docs/runtime.md);
  * idle_ms: the median time from a step's read to the next step's forward less the device work between (a
    drafter's graphs): what a GPU idles through in all when that work does not overlap the host's; exposed_ms
    where nothing runs between;
  * floor_ms: a bare loop of the same forward + sampling of the next token, no engine around it (plain rows only):
    the least a step can cost on this model;
  * host_ops, host_calls: torch ops dispatched and Python calls made per step outside the target forward, counted
    in one more pair of calls after the timed ones (untimed: counting slows them). Unlike the clocks they do not
    move with the machine's load, so a change to the host path reads as a change of these counts on any machine;
    on a GPU each host op is a launch or a copy the device waits for.

Repetitions alternate the modes (medians). On a GPU the host part is what the device idles through unless the next
step is prepared while the current one runs (docs/runtime.md#host-step-budget).

    python -m rlspec.bench host                       # ~1 min on 2 cores
    python -m rlspec.bench host --batch-sizes 8 --reps 5
    python -m rlspec.bench host --modes plain chain --batch-sizes 64 --waves 4   # samples waiting for rows
    python -m rlspec.bench host --modes plain suffix --batch-sizes 64 --group 8  # GRPO groups: siblings to draft from
"""
from __future__ import annotations

import statistics
import time

from rlspec.bench import harness

NAME = "host"
HELP = "host milliseconds per decode step on a negligible-compute model (plain, chain, tree; batch 1 / 8 / 64)"
MODES = {  # name -> SpecConfig fields (None: plain decoding)
    "plain": None,
    "chain": dict(drafter="ngram", selector="always", num_draft_tokens=4, tree_width=1),
    "tree": dict(drafter="ngram", selector="always", num_draft_tokens=4, tree_width=2),
    # the same chains where the host drafter drafts, looked up on the device (every row drafts)
    "ngram_device": dict(drafter="ngram_device", selector="always", num_draft_tokens=4, tree_width=1),
    # the model-free drafter of GRPO recipes: siblings, earlier rollouts, the global window (a 4-token chain)
    "suffix": dict(drafter="suffix", selector="always", num_draft_tokens=4, tree_width=1),
    # suffix's chains, the device lookup's for the rows suffix leaves empty
    "suffix_device": dict(drafter="suffix_device", selector="always", num_draft_tokens=4, tree_width=1),
    "eagle3": dict(drafter="eagle3", selector="always", num_draft_tokens=4, tree_width=1),
    # the same engine with every step plain (the selector's arm forced off): what a run with a learned drafter pays on
    # the steps where drafting does not pay (a large batch), its features still staged for the drafter
    "eagle3_plain": dict(drafter="eagle3", selector="always", num_draft_tokens=4, tree_width=1, off=True),
}
MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)
COLUMNS = ["mode", "batch", "ms_per_step", "forward_ms", "host_ms", "exposed_ms", "idle_ms", "cpu_ms_per_step",
           "cpu_forward_ms",
           "cpu_host_ms", "host_ops", "host_calls", "steps", "spec_share"]
INIT = 1.0  # weights drawn wide: peaked logits, so sampled rollouts repeat and the n-gram drafter drafts


def add_arguments(p) -> None:
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--tokens", type=int, nargs=2, default=[16, 112],
                   help="max_new_tokens of the short and the long call (their difference is what is timed)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--waves", type=int, default=1,
                   help="samples in this many waves of batch rows: the later ones wait while the rows are taken, "
                        "a GRPO rollout's usual state (more samples than rows)")
    p.add_argument("--group", type=int, default=1,
                   help="samples per prompt (SamplingParams.n): a GRPO group's siblings, what the suffix drafter "
                        "drafts from; the batch's rows hold batch / group prompts")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the host's own cost, no pool wake-ups)")


def tiny_model(seed: int = 0, device=None):
    """The negligible-compute target: a 1-layer random Llama in the engine's runtime, float32 (on `device`: the CPU
    by default)."""
    import torch
    import transformers as tf

    from rlspec.rollout.runtime.model import loader

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(**MODEL, max_position_embeddings=1024, initializer_range=INIT, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    return loader.from_hf_model(tf.LlamaForCausalLM(cfg).float().eval(), device=device)


def build(mode: str, batch: int, seed: int):
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.speculation.selectors.base import OFF
    from rlspec.rollout.types import SpecConfig

    fields = dict(MODES[mode] or {})
    off = fields.pop("off", False)
    spec = SpecConfig(**fields, online_training=False) if fields else None
    engine = RolloutEngine(tiny_model(seed), None, spec=spec, eos_token_ids=[2], max_num_seqs=max(batch, 1),
                           max_model_len=512)
    for drafter in engine.speculation.by_name.values() if engine.speculation is not None else ():
        if hasattr(drafter, "graph_mode"):  # the CUDA path's host work (module docstring): graphs, emulated
            drafter.graph_mode = "emulate"
    if engine.speculation is not None and engine.speculation.learned is not None:
        engine.speculation.learned.early = True  # the catch-up before the verify's read, as on CUDA
    if off:
        engine.speculation.force(OFF)
    return engine


class ForwardTimer:
    """Wraps the engine's ModelRunner.step and the drafters' graph replays: wall and CPU seconds of device work
    (target forwards of decode steps, the drafters' graphs); `inside` is > 0 while one runs (what host_counts leaves
    out). Wraps its transfers' reads too: `gaps` holds the seconds from each read to the next device work
    (exposed_ms), `idles` those to the next target forward less the device work between (idle_ms)."""

    def __init__(self, engine):
        self.wall = self.cpu = 0.0
        self.inside = 0
        self.read_at, self.gaps, self.idles = None, [], []
        self.first_work = self.between = None  # since the last read: when device work first ran, and its seconds
        runner, inner, to_host = engine.runner, engine.runner.step, engine.runner.transfers.to_host

        def send(*columns):
            return _TimedRead(to_host(*columns), self)

        runner.step = lambda *a, **kw: self.device_work(inner, *a, target=True, **kw)
        runner.transfers.to_host = send
        for graphs in _graph_sets(engine):
            graphs.replay = (lambda replay: lambda *a, **kw: self.device_work(replay, *a, **kw))(graphs.replay)

    def read(self) -> None:
        self.read_at, self.first_work, self.between = time.perf_counter(), None, 0.0

    def device_work(self, fn, *a, target: bool = False, **kw):
        t0 = time.perf_counter()
        if self.read_at is not None and self.first_work is None:  # the first device work since the read
            self.first_work = t0
            self.gaps.append(t0 - self.read_at)
        if self.read_at is not None and target:  # the next step's forward: the device idled until now but for `between`
            self.idles.append(t0 - self.read_at - self.between)
            self.read_at = None
        self.inside += 1
        try:
            c0 = time.process_time()
            out = fn(*a, **kw)
            spent = time.perf_counter() - t0
            self.wall += spent
            self.cpu += time.process_time() - c0
            if self.read_at is not None:
                self.between += spent
            return out
        finally:
            self.inside -= 1


def _graph_sets(engine) -> list:
    """The drafters' GraphSets (runtime/graphs.py): an EAGLE-3 drafter's levels, the device n-gram lookup's."""
    out = []
    for drafter in engine.speculation.by_name.values() if engine.speculation is not None else ():
        if hasattr(drafter, "level_graphs"):
            levels = drafter.level_graphs()
            out += [] if levels is None else [levels.graphs]
        elif hasattr(drafter, "graph_set"):
            out += [drafter.graph_set()]
    return [g for g in out if g is not None]


class _TimedRead:
    """A transfer in flight whose read (rows()) notes the time in its timer."""

    def __init__(self, pending, timer: ForwardTimer):
        self.pending, self.timer = pending, timer

    def rows(self):
        rows = self.pending.rows()
        self.timer.read()
        return rows


def call(engine, timer: ForwardTimer, prompts, tokens: int, args, seed: int) -> dict:
    """Wall and CPU seconds of one generate call and of its forwards, its decode steps, and the share of them
    that carried drafts."""
    params = _params(tokens, args, seed)
    engine.batch_trace.clear()
    fw, fc = timer.wall, timer.cpu
    timer.read_at, timer.gaps, timer.idles = None, [], []
    t0, c0 = time.perf_counter(), time.process_time()
    engine.generate(prompts, params)
    out = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "fwd_wall": timer.wall - fw,
           "fwd_cpu": timer.cpu - fc, "steps": len(engine.batch_trace),
           "exposed": statistics.median(timer.gaps) if timer.gaps else 0.0,
           "idle": statistics.median(timer.idles) if timer.idles else 0.0}
    out["spec_share"] = engine.stats().get("rollout/spec_step_share", 0.0)
    return out


def measure(engine, timer, prompts, args, rep: int) -> dict:
    """One repetition of a (mode, batch): per-step figures from the long call minus the short one, in ms. The CPU
    clock (one torch thread: every op runs in this thread) is what other processes on a shared machine disturb
    least; the wall clock is what a device would wait."""
    short, long = (call(engine, timer, prompts, n, args, args.seed + rep) for n in args.tokens)
    steps = long["steps"] - short["steps"]
    if steps <= 0:
        raise RuntimeError(f"the long call ran {long['steps']} steps, the short one {short['steps']}: raise --tokens")
    per = {k: (long[k] - short[k]) / steps * 1e3 for k in ("wall", "cpu", "fwd_wall", "fwd_cpu")}
    return {"ms_per_step": per["wall"], "forward_ms": per["fwd_wall"], "host_ms": per["wall"] - per["fwd_wall"],
            "exposed_ms": long["exposed"] * 1e3, "idle_ms": long["idle"] * 1e3,
            "cpu_ms_per_step": per["cpu"], "cpu_forward_ms": per["fwd_cpu"], "cpu_host_ms": per["cpu"] - per["fwd_cpu"],
            "steps": long["steps"], "spec_share": long["spec_share"]}


def host_counts(engine, timer: ForwardTimer, prompts, args) -> dict:
    """Torch ops dispatched and Python calls made per decode step outside the target forward (ModelRunner.step, as
    the timer sees it): the long call's counts minus the short one's over their difference in steps, as the clocks
    are taken."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {"ops": 0, "calls": 0}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not timer.inside:
                seen["ops"] += 1
            return func(*args, **(kwargs or {}))

    def profile(frame, event, arg):
        if not timer.inside and event in ("call", "c_call"):
            seen["calls"] += 1

    def count(n: int, what: str) -> tuple[int, int]:
        """(decode steps, ops or calls) of one call of n tokens; each counted in a pass of its own (the op
        counter's own Python calls are not the engine's)."""
        seen[what] = 0
        engine.batch_trace.clear()
        if what == "ops":
            with Ops():
                engine.generate(prompts, _params(n, args, args.seed))
        else:
            sys.setprofile(profile)
            try:
                engine.generate(prompts, _params(n, args, args.seed))
            finally:
                sys.setprofile(None)
        return len(engine.batch_trace), seen[what]

    out = {}
    for what in ("ops", "calls"):
        (s0, c0), (s1, c1) = (count(n, what) for n in args.tokens)
        out[f"host_{what}"] = (c1 - c0) / (s1 - s0)
    return out


def _params(tokens: int, args, seed: int):
    from rlspec.rollout.types import SamplingParams

    return SamplingParams(temperature=args.temperature, max_new_tokens=tokens, ignore_eos=True, seed=seed,
                          n=args.group)


def floor_ms(batch: int, steps: int, seed: int, temperature: float) -> tuple[float, float]:
    """A bare loop of the target's forward over one token per row + drawing the next token: (wall, CPU) ms per
    step."""
    import torch

    from rlspec.rollout.runtime.runner import ModelRunner
    from rlspec.rollout.runtime.sampling import sample_plain
    from rlspec.rollout.types import SamplingParams

    model = tiny_model(seed)
    runner = ModelRunner(model, "cpu", torch.float32, "off", compile_mode="off")
    cache = runner.ensure_cache(batch, steps + 16)
    cache.reset()
    cache.reserve_rows(batch, steps + 8)
    params = SamplingParams(temperature=temperature, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.full((batch, 1), 5, dtype=torch.long)
    start = torch.zeros(batch, dtype=torch.long)
    t0 = c0 = 0.0
    with torch.inference_mode():
        for i in range(steps):
            if i == 4:
                t0, c0 = time.perf_counter(), time.process_time()
            logits, _ = runner.step(tokens, start)
            drawn = sample_plain(logits[:, 0], params, gen)
            tokens = (drawn[0] if drawn is not None else logits[:, 0].argmax(-1))[:, None]
            start += 1
    return (time.perf_counter() - t0) / (steps - 4) * 1e3, (time.process_time() - c0) / (steps - 4) * 1e3


def prompts(batch: int, seed: int) -> list[list[int]]:
    """batch random prompts of 8-24 tokens over the model's vocabulary (ids 3.. : no special token)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [torch.randint(3, MODEL["vocab_size"], (n,), generator=g).tolist() for n in lens]


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if args.smoke:
        args.batch_sizes, args.tokens, args.reps = [2], [4, 12], 1
    undivided = [b for b in args.batch_sizes if args.group < 1 or b * args.waves % args.group]
    if undivided:
        raise SystemExit(f"--group {args.group} must be >= 1 and divide every batch's samples (batch x --waves "
                         f"{args.waves}); it does not for batch {', '.join(map(str, undivided))}")
    rows = []
    for batch in args.batch_sizes:
        # the engine holds `batch` rows (build): the rest wait
        ps = prompts(batch * args.waves // args.group, args.seed)
        engines = {m: build(m, batch, args.seed) for m in args.modes}
        timers = {m: ForwardTimer(e) for m, e in engines.items()}
        for m, e in engines.items():  # warm: first calls allocate the pool and build the drafters' state
            call(e, timers[m], ps, args.tokens[0], args, args.seed)
        runs = harness.alternate({m: (lambda rep, m=m: measure(engines[m], timers[m], ps, args, rep))
                                  for m in args.modes}, args.reps)
        floor = floor_ms(batch, max(args.tokens), args.seed, args.temperature)
        for m in args.modes:
            med = {k: statistics.median([r[k] for r in runs[m]]) for k in runs[m][0]}
            med.update(host_counts(engines[m], timers[m], ps, args))
            rows.append({"mode": m, "batch": batch, **{k: med[k] for k in COLUMNS[2:-2]}, "steps": int(med["steps"]),
                         "spec_share": med["spec_share"], "floor_ms": floor[0] if m == "plain" else None,
                         "cpu_floor_ms": floor[1] if m == "plain" else None,
                         "reps_host_ms": [r["host_ms"] for r in runs[m]]})
            print(f"[host] batch {batch} {m}: {med['ms_per_step']:.3f} ms/step (forward {med['forward_ms']:.3f}, "
                  f"host {med['host_ms']:.3f}, exposed {med['exposed_ms']:.3f}, idle {med['idle_ms']:.3f}; CPU clock: host "
                  f"{med['cpu_host_ms']:.3f}; host ops {med['host_ops']:.1f}, Python calls {med['host_calls']:.0f})",
                  flush=True)
    return {"model": MODEL, "threads": args.threads, "temperature": args.temperature, "rows": rows,
            "columns": COLUMNS + ["floor_ms", "cpu_floor_ms"]}
