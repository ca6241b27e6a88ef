"""Device kernels per decode step: what each CUDA graph replays, counted on the CPU.

A step's graph replays one kernel per tensor op of the step's forward, and on a GPU each small kernel costs ~2 us
of device time plus its share of the graph's launch on the host (docs/gpu.md#where-a-step-goes: at batch 1 the
Qwen2.5-7B step spent ~2 ms of 6.3 in ~900 small elementwise kernels). The count depends on the model's ops, not
on the device, so it is measured here, exactly, on any machine: a dispatch mode counts the ops that produce data
(views and allocations are not kernels; a dtype conversion that copies is), with the ops CUDA runs as one kernel
counted as one (`CudaChoices`: FlexAttention; torch's fused RMSNorm), where the CPU runs several.

Rows, for a Qwen2.5-7B-shaped model scaled down (the same ops: grouped heads, q|k|v bias, SwiGLU; a layer's
count does not depend on its sizes), in bfloat16 (what GPUs run) and float32, at T = 1 (decode) and T = 5 (a
4-token chain's verify), with each RMSNorm as torch's fused kernel (norm "fused", what CUDA runs:
llama.fused_norm), as HF's arithmetic (norm "hf", the CPU's), and, in bf16, with every product of a few rows as our
Triton kernel, the norms before q|k|v, gate|up and the LM head and SiLU times up before down inside it (norm "ours":
where fused_ops measured that kernel faster than cuBLAS on the device):
  * layer: kernels of one decoder layer, and by op;
  * head: the final norm, the LM head and the logits' conversion;
  * eagle3_level: one EAGLE-3 draft level (the drafter's layer and its draft-vocabulary logits);
  * launches_per_proposal, launches_per_level (over the proposal's depth): the kernels a sampled EAGLE-3 proposal
    (batch --batch, a 1-layer target; its catch-up, draws and the drafts' assembly; a chain of 4, and a tree of
    two branches of 2) launches from Python, outside any graph, a graph replay counted as one: eager (graph_mode
    "off") and from graphs (bookkeeping emulated on the CPU: the ops a CUDA graph replays are not counted). On a
    GPU each is a launch the host makes, which the device waits for where it has nothing else queued;
  * launches_per_step: the kernels a whole decode step launches outside the target's forward (one graph), on the
    host benchmark's model (bench/host.py) at batch --batch and 64, sampled (T = 1) and greedy: plain, a 4-token
    n-gram chain, an n-gram tree of width 2, an EAGLE-3 chain (its graphs counted as one launch each), with the
    CPU's draw kernels off, as on CUDA: the verify, the draws, the transfer's columns, a learned drafter's staging.

    python -m rlspec.bench kernels          # ~20 s
"""
from __future__ import annotations

import collections

NAME = "kernels"
HELP = "device kernels per decode step: one decoder layer, the head and an EAGLE-3 level, by op (CPU, exact)"
COLUMNS = ["dtype", "norm", "tokens", "layer", "head", "step_rest", "eagle3_level", "layer_ops"]
LEVEL_COLUMNS = ["graph_mode", "width", "proposals", "launches_per_level", "launches_per_proposal"]
STEP_COLUMNS = ["mode", "batch", "temperature", "launches_per_step"]
SHAPE = dict(vocab_size=512, hidden_size=112, intermediate_size=296, num_hidden_layers=2, num_attention_heads=28,
             num_key_value_heads=4)  # Qwen2.5-7B's heads (28 of 4 groups) with head_dim 4; its widths / 32
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias"}
RENAMED = {"_to_copy": "to"}  # outside inference mode a conversion dispatches as the copy itself


class DeviceOps:
    """A context that counts, by name, the ops dispatched inside it that would each launch a device kernel."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.paused = False  # ops inside a call counted as one kernel (`as_one`)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = RENAMED.get(func.overloadpacket.__name__, func.overloadpacket.__name__)
                if not ops.paused and name not in ALLOCATIONS and (not func.is_view or _copied(out, args)):
                    ops.counts[name] += 1
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def as_one(self, name: str | None, fn, *args, **kwargs):
        """fn(*args, **kwargs) counted as one kernel `name` (None: as none), whatever ops it runs, counted ones
        among them (a kernel whose stand-in calls another: our product's reference runs torch's norm)."""
        outer, self.paused = self.paused, True
        try:
            return fn(*args, **kwargs)
        finally:
            self.paused = outer
            if name is not None and not outer:
                self.counts[name] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _copied(out, args) -> bool:
    """A view op that made new data: `to` a dtype (HF's casts) dispatches as a view but copies."""
    import torch

    first = args[0] if args else None
    return isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and \
        out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def add_arguments(p) -> None:
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 5])


def target(dtype):
    """The scaled-down Qwen2.5-7B shape in the engine's runtime, random weights."""
    import torch
    import transformers as tf

    from rlspec.rollout.runtime.model import loader

    torch.manual_seed(0)
    hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, max_position_embeddings=256))
    return loader.from_hf_model(hf.to(dtype).eval())


def _as_the_paged_kernel_lays_out(attend):
    """attend's output [B, H, T, D] in the paged kernel's layout, a transposed view of [B, T, H, D] (paged_decode.py),
    which the layer's o product reads without a copy: inside the one kernel counted for it, not a copy after."""
    return lambda *args: attend(*args).transpose(1, 2).contiguous().transpose(1, 2)


class CudaChoices:
    """While open, the model's ops run as they do on CUDA where that changes their kernels, each counted as one
    kernel into `ops` (None: uncounted): a step's cache in 128-position blocks and its attention paged, as Triton's
    kernel reads the pool in place (no block mask, no gather: attention.attend_paged, computed densely here) and,
    with `fused_norm`, each RMSNorm as torch's fused kernel (llama.fused_norm) and, in 16 bits, a step's rotation
    and KV writes (a drafter's q and k rotation) and each MLP's silu(gate) * up as our Triton kernels
    (fused_ops.triton_serves); no CPU kernel serves (model/kernels). With `products`, every product of a few rows
    as our few-rows kernel (model/few_rows.py, the norms before q|k|v, gate|up and the LM head and SiLU times up
    before down inside it), as where fused_ops measured it faster on the device. Open it before the runner is made
    (its cache takes CUDA's block size)."""

    def __init__(self, fused_norm: bool, products: bool = False):
        self.fused_norm, self.products, self.ops = fused_norm, products, None

    def __enter__(self):
        import torch.nn.functional as F

        from rlspec.rollout.runtime import graphs, runner
        from rlspec.rollout.runtime.model import attention, fused_ops, kernels, llama

        self.undo = []  # (module, name, value before), restored in reverse by __exit__

        def put(module, name, value):
            self.undo.append((module, name, getattr(module, name)))
            setattr(module, name, value)

        def counted(name, fn):
            return lambda *a, **kw: fn(*a, **kw) if self.ops is None else self.ops.as_one(name, fn, *a, **kw)

        put(kernels, "ready", False)  # the CPU kernels (AVX-512 BF16 machines) serve no CUDA step
        put(attention, "use_paged_decode", lambda device: True)
        put(graphs, "use_flex", lambda device: True)
        put(runner, "use_flex", lambda device: True)
        put(llama, "attend", counted("attention", llama.attend))
        put(llama, "gather_blocks", counted(None, llama.gather_blocks))
        put(llama, "attend_paged", counted("attention", _as_the_paged_kernel_lays_out(attention.attend_paged_dense)))
        if self.fused_norm:
            put(llama, "fused_norm", lambda x, weight: x.dtype == weight.dtype)
            put(F, "rms_norm", counted("rms_norm", F.rms_norm))
            # our Triton kernels (model/rope_write.py, silu_mul.py), where fused_ops.triton_serves picks them on CUDA
            put(fused_ops, "triton_serves", lambda x, errors: x.element_size() == 2)
            put(fused_ops, "_fused_rotation", counted("rope_write", fused_ops.rotate_and_write))
            put(fused_ops, "_fused_silu_mul", counted("silu_mul", fused_ops.silu_times))
            put(fused_ops, "_fused_pair", counted("rope_pair", fused_ops.rope_pair))
        if self.products:
            put(fused_ops, "_timed_here", lambda x: True)
            put(fused_ops, "_faster_here", lambda key, ours, theirs: True)
            put(fused_ops, "_fused_product", counted("few_rows", fused_ops.torch_product))
        return self

    def __exit__(self, *exc):
        for module, name, value in reversed(self.undo):
            setattr(module, name, value)


def layer_counts(model, dtype, batch: int, tokens: int, fused_norm: bool = True,
                 products: bool = False) -> tuple[DeviceOps, DeviceOps, DeviceOps]:
    """(first decoder layer, head, the rest of the step) kernels of one step of `tokens` new tokens per row over
    `batch` rows, as CUDA runs them (`CudaChoices`; fused_norm False: HF's norm arithmetic, the CPU's; products:
    our few-rows kernel for every product it can take). The rest:
    what a step launches outside its layers and head (the embedding, the rows' slots, the RoPE rows)."""
    import torch

    from rlspec.rollout.runtime.model import llama
    from rlspec.rollout.runtime.model.linear import Linear, unpack_linears
    from rlspec.rollout.runtime.runner import ModelRunner

    layer, head, rest = DeviceOps(), DeviceOps(), DeviceOps()
    first = model.model.layers[0]
    with CudaChoices(fused_norm, products) as cuda:
        runner = ModelRunner(model, "cpu", dtype, "off", compile_mode="off")
        unpack_linears(model)  # F.linear, as on CUDA: not the CPU's packed bf16 copies (model/linear.py)
        for m in model.modules() if products else ():  # ... and fused_ops.product, which CUDA's Linears call
            if isinstance(m, Linear):
                m.plain = False
        cache = runner.ensure_cache(batch, 256)
        cache.reset()
        cache.reserve_rows(batch, 48)
        with torch.inference_mode():
            model.rope_tables(dtype)  # made once per table, not a step's work

        def call(fn, *args):
            cuda.ops = layer if fn is first else head if fn is llama._head else None
            if cuda.ops is None:
                return rest.as_one(None, fn, *args)
            try:
                with cuda.ops:
                    return rest.as_one(None, fn, *args)
            finally:
                cuda.ops = None

        inputs = torch.full((batch, tokens), 5), torch.full((batch,), 9)  # the step's (a graph's static buffers)
        with torch.inference_mode(), rest:
            runner.steps.run(*inputs, layer_call=call)
    return layer, head, rest


def eagle3_counts(model, dtype, batch: int, fused_norm: bool = True, products: bool = False) -> DeviceOps:
    """Kernels of one EAGLE-3 draft level over `batch` rows: the drafter's layer on its previous output and the
    drafted token's embedding, then its draft-vocabulary logits, as CUDA runs them (`CudaChoices`)."""
    import torch

    from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model

    drafter = Eagle3Model(Eagle3Config.for_target(model.cfg, draft_vocab_size=128)).to(dtype)
    model.init_rope(64)
    pos = torch.full((batch, 1), 9)
    cos, sin = model.rope_cos[pos].to(dtype)[:, :, None], model.rope_sin[pos].to(dtype)[:, :, None]
    h = torch.randn(batch, 1, model.cfg.hidden_size, dtype=dtype)
    embeds = model.model.embed_tokens(torch.full((batch, 1), 7))
    ops = DeviceOps()

    def attend(q, k, v):
        ops.counts["attention"] += 1
        return q  # the level's shapes, without the CPU's attention ops

    with CudaChoices(fused_norm, products) as cuda, torch.inference_mode(), ops:
        cuda.ops = ops
        drafter.logits(drafter(h, embeds, cos, sin, attend))
    return ops


def level_launches(batch: int, graph_mode: str, depth: int = 4, width: int = 1) -> dict:
    """Kernels launched outside graphs by the EAGLE-3 drafter's proposals (`propose`: the catch-up, the draws and the
    drafts' assembly; the catch-up run early, after the verify before, eagle3_catch_up.py) of one sampled rollout, a
    graph replay counted as one launch: chains of `depth` (width 1), or `width` branches of depth // width."""
    from rlspec.bench.host import prompts, tiny_model
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.graphs import GraphSet
    from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
    from rlspec.rollout.speculation.selectors.base import Arm
    from rlspec.rollout.types import SamplingParams, SpecConfig

    spec = SpecConfig(drafter="eagle3", num_draft_tokens=depth, online_training=False)
    engine = RolloutEngine(tiny_model(), None, spec=spec, eos_token_ids=[2], max_num_seqs=batch, max_model_len=256)
    engine.speculation.learned.graph_mode = graph_mode
    engine.speculation.learned.early = True  # the catch-up before the verify's read, as on CUDA
    engine.speculation.force(Arm("eagle3", depth // width, width))
    ops, seen = DeviceOps(), []
    propose, draft, replay = Eagle3Drafter.propose_tensors, Eagle3Drafter._draft, GraphSet.replay
    early = Eagle3Drafter._catch_up_early

    def counted_propose(self, *a):
        with ops:
            return propose(self, *a)

    def counted_early(self, *a):
        with ops:
            return early(self, *a)

    def noted_draft(self, seqs, h, d, w, *rest):
        seen.append(d)
        return draft(self, seqs, h, d, w, *rest)

    def one_launch(self, key, fn, keep=None):  # a CUDA graph's kernels are one launch, counted as such
        return ops.as_one("graph", replay, self, key, fn, keep)

    Eagle3Drafter.propose_tensors, Eagle3Drafter._draft, GraphSet.replay = counted_propose, noted_draft, one_launch
    Eagle3Drafter._catch_up_early = counted_early
    try:
        engine.generate(prompts(batch, 0), SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=0))
    finally:
        Eagle3Drafter.propose_tensors, Eagle3Drafter._draft, GraphSet.replay = propose, draft, replay
        Eagle3Drafter._catch_up_early = early
    return {"graph_mode": graph_mode, "width": width, "proposals": len(seen),
            "launches_per_level": ops.total / max(sum(seen), 1),
            "launches_per_proposal": ops.total / max(len(seen), 1), "ops": dict(sorted(ops.counts.items()))}


def step_launches(mode: str, batch: int, temperature: float) -> dict:
    """Kernels a decode step launches outside the target's forward (a CUDA graph's replay: the verify, the draws,
    the transfer's columns, a learned drafter's staging and its proposal, a drafter graph counted as one) on the
    host benchmark's model and modes (bench/host.py), with the CPU's draw kernels off, as on CUDA: the long call's
    count minus the short one's over their difference in steps."""
    import torch

    from rlspec.bench.host import build, prompts
    from rlspec.rollout.runtime import graphs, sampling
    from rlspec.rollout.speculation import verify
    from rlspec.rollout.types import SamplingParams

    engine, ops = build(mode, batch, 0), DeviceOps()
    step = engine.runner.step
    engine.runner.step = lambda *a, **kw: ops.as_one(None, step, *a, **kw)  # the forward: a graph of its own
    replay, draws = graphs.GraphSet.replay, (sampling.kernel_draws, verify.kernel_draws)
    graphs.GraphSet.replay = lambda self, key, fn, keep=None: ops.as_one("graph", replay, self, key, fn, keep)
    sampling.kernel_draws = verify.kernel_draws = lambda *a: False
    counts = {}
    try:
        with torch.inference_mode():
            for n in (16, 48):
                ops.counts.clear()
                engine.batch_trace.clear()
                with ops:
                    engine.generate(prompts(batch, 0), SamplingParams(temperature=temperature, max_new_tokens=n,
                                                                      ignore_eos=True, seed=0))
                counts[n] = (len(engine.batch_trace), ops.total)
    finally:
        graphs.GraphSet.replay, (sampling.kernel_draws, verify.kernel_draws) = replay, draws
    steps = counts[48][0] - counts[16][0]
    return {"mode": mode, "batch": batch, "temperature": temperature,
            "launches_per_step": (counts[48][1] - counts[16][1]) / steps}


def run(args) -> dict:
    import torch

    rows = []
    for name in ("bfloat16", "float32"):
        dtype = getattr(torch, name)
        model = target(dtype)
        modes = [("fused", True, False), ("hf", False, False)] + ([("ours", True, True)] if name == "bfloat16" else [])
        for norm, fused, products in modes:
            level = eagle3_counts(model, dtype, args.batch, fused, products)
            for t in args.tokens:
                layer, head, rest = layer_counts(model, dtype, args.batch, t, fused, products)
                rows.append({"dtype": name, "norm": norm, "tokens": t, "layer": layer.total, "head": head.total,
                             "step_rest": rest.total, "eagle3_level": level.total,
                             "layer_ops": dict(sorted(layer.counts.items())),
                             "head_ops": dict(sorted(head.counts.items())),
                             "rest_ops": dict(sorted(rest.counts.items())),
                             "eagle3_ops": dict(sorted(level.counts.items()))})
                print(f"[kernels] {name}, {norm} norms, T={t}: layer {layer.total}, head {head.total}, rest of the "
                      f"step {rest.total}, EAGLE-3 level {level.total}", flush=True)
    levels = [level_launches(args.batch, mode, width=w) for w in (1, 2) for mode in ("off", "emulate")]
    for r in levels:
        print(f"[kernels] EAGLE-3 proposals, {'chains' if r['width'] == 1 else 'trees of width 2'}, graphs "
              f"{r['graph_mode']}: {r['launches_per_proposal']:.1f} launches a proposal ({r['launches_per_level']:.1f} "
              "a level)", flush=True)
    steps = [step_launches(mode, b, t) for b in sorted({args.batch, 64}) for t in (1.0, 0.0)
             for mode in ("plain", "chain", "ngram_device", "tree", "eagle3")]
    for r in steps:
        print(f"[kernels] decode step, {r['mode']}, batch {r['batch']}, T={r['temperature']:g}: "
              f"{r['launches_per_step']:.1f} launches outside the forward", flush=True)
    return {"shape": SHAPE, "batch": args.batch, "rows": rows, "columns": COLUMNS, "levels": levels,
            "level_columns": LEVEL_COLUMNS, "steps": steps, "step_columns": STEP_COLUMNS}
