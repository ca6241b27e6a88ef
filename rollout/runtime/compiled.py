"""Compiled step forwards: the decoder layer compiled once by torch.compile and reused by every layer; on a CPU,
where the model allows, the fused step instead (model/fused.py: each layer one C++ op, nothing to compile).

Why (docs/runtime.md#compiled-steps-and-packed-weights): a batch-1 decode step streams every weight once,
and an eager step wastes most of it: ~70 small ops a layer pay Python and dispatcher overhead, and torch's
single-row bf16 matmul streams weights at half the speed a fused reduction reaches (model/linear.py).
Compiled, the norms, rotary, residuals and attention fuse into a few generated kernels and each single-row
product becomes a vectorised multiply-and-sum.

How (regional compilation): one `torch.compile` of a call `fn(*args)` serves every layer, because dynamo
treats the layers' parameters as graph inputs, so compile time is that of one layer (seconds), not of
the whole model (minutes); the model's head (final norm, LM head) is compiled through the same call.
What changes a graph:
  * T, the tokens per row (1 = decode, k+1 = chain verify, nodes+1 = tree), padded to a power of two
    (`graphs.pow2_buckets`); padding nodes extend the row as a chain and their keys land past the
    row's length, where no mask looks (the CUDA graph pool pads the same way, graphs.py).
  * the batch: dynamic (one graph for every B > 1; B = 1 gets its own, as torch specialises size 1). Under
    CUDA graphs the captured call is compiled with every activation dim dynamic (`captured_layer_call`).
  * S, the cache positions read: dynamic (marked before the first call), so a rollout's growing
    context never recompiles.
The paged KV write is an index_put on the layer's pool, a graph input, which inductor performs in place.

On a CPU only steps of up to 16 tokens over up to 8 rows compile, where our bf16 kernels for few-row products and
paged attention are available (model/kernels; without them, single-token batch-1 steps only);
other shapes run eagerly on packed weights, as fast or faster (model/linear.py). Artefacts (the FX graph and
AOT caches) go under $RLSPEC_CACHE/inductor, so a machine compiles once and later processes load the kernels
in a fraction of the time; `warm` compiles (or loads) a call's graphs before its first step, so that none
compiles inside a rollout. `compile_mode="off"` keeps the eager path.
"""
from __future__ import annotations

import os

import torch

from rlspec.rollout.runtime.graphs import EagerRunner, bucket_for, pad_batch, pow2_buckets, start_top
from rlspec.rollout.runtime.model import fused

COMPILE_MODES = ("off", "on", "auto")
CPU_MAX_DECODE_BATCH = 8  # plain decode steps of more rows run eagerly on a CPU (16 rows: 51 vs 48 ms eager)
MAX_COMPILED_T = 32  # verify sizes above this run eagerly (trees of more nodes are rare and costly anyway)
RECOMPILE_LIMIT = 64


def inductor_cache_dir(root: str | None = None) -> str:
    """Point inductor's on-disk caches at $RLSPEC_CACHE/inductor unless the user chose a directory; one that
    other users can write is swapped for a private one (it holds compiled code that this process loads)."""
    from pathlib import Path

    from rlspec.rollout.runtime.model.fetch import cache_root
    from rlspec.rollout.runtime.model.kernels.trust import private_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_root(root) / "inductor")
    path = str(private_dir(Path(chosen), "inductor's compiled graphs"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def resolve_compile(mode: str, device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether steps are compiled. auto: on a CPU in bf16, where it was measured to pay (bench_out/step.json);
    off in float32, and off on CUDA: measured there (docs/gpu.md), compiled graphs ran 1.2-1.4x
    faster but recompiled every shape for each new KV pool size (3-8 s a shape), and training re-sizes the pool per
    rollout. FlexAttention now stays outside the layer's graphs, which take any pool size (captured_layer_call); the
    graphs' speed with that graph break is unmeasured on a GPU, so CUDA stays off until `make gpu-check` has run it."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    if mode == "auto":
        return torch.device(device).type == "cpu" and dtype == torch.bfloat16
    return mode == "on"


def compiled_layer_call(dynamic: bool = False):
    """A function (layer, *args) -> layer(*args) compiled once per process; dynamo treats the layer's
    parameters as inputs, so every layer (and every model of the same class) shares its graphs.
    dynamic: every activation dimension symbolic from the first compile (captured_layer_call's, see there);
    False: static shapes but the dims `_marking` marks (the CPU steps, whose layers have no graph break)."""
    if dynamic not in _LAYER_CALLS:
        import torch._dynamo

        inductor_cache_dir()
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))

        def call(fn, *args):  # a layer, or the model's head function (llama._head)
            return fn(*args)

        _LAYER_CALLS[dynamic] = torch.compile(call, dynamic=dynamic)
    return _LAYER_CALLS[dynamic]


_LAYER_CALLS: dict = {}  # dynamic -> the compiled call


class CompiledRunner(EagerRunner):
    """EagerRunner's API; the layers run through the compiled layer call, T padded to a power of two. On a CPU,
    steps of up to fused.MAX_TOKENS tokens run fused where the model allows (`fused`; model/fused.py): the layer
    as one op, any T, no compile; the compiled call serves the other models."""

    CPU_EVERY_SHAPE = False  # tests set it True to run every shape compiled on the CPU, as on CUDA

    def __init__(self, model, cache, device, max_t: int = MAX_COMPILED_T):
        super().__init__(model, cache, device)
        self.t_buckets = pow2_buckets(1, max_t)
        self.layer_call = compiled_layer_call()
        self.seen: set[tuple] = set()  # (batched, t) keys whose graphs exist: their inputs need no marks
        self.max_rows = self.cpu_max_rows(model) if self.device.type == "cpu" and not self.CPU_EVERY_SHAPE else None
        # steps that would compile run fused instead, where the model allows (model/fused.py)
        self.fused = fused.FusedLayers(model) if self.device.type == "cpu" and fused.usable(model) else None
        self.counts = {"fused": 0, "compiled": 0, "eager": 0}

    @staticmethod
    def cpu_max_rows(model) -> int:
        """Most tokens (rows x tokens per row) a compiled CPU step takes: 1-16 where the CPU has our bf16 kernels
        (model/kernels: the products stream each weight once for all 16, attention reads the paged cache in place),
        else one (its products then fused reductions, model/linear.py). Bigger steps run eagerly on packed weights:
        at 16 one-token rows compiled was slower (51 vs 48 ms, docs/runtime.md#verify-steps-on-the-cpu)."""
        from rlspec.rollout.runtime.model import kernels

        bf16 = next(model.parameters()).dtype == torch.bfloat16
        return kernels.MAX_ROWS if bf16 and kernels.available() else 1

    def compiles(self, B: int, t: int | None) -> bool:
        """Whether a step of B rows of t (bucketed) tokens runs compiled on this device: on a CPU, up to 16 tokens
        in all over at most CPU_MAX_DECODE_BATCH rows (a verify at batch 1, the batched verify or plain decode of
        a rollout's tail). Several rows of several tokens were slower compiled until attention read the cache
        through the kernel (2 x 4 tokens 33.7 vs 32.0 ms eager before, 32.6 vs 37.0 after)."""
        if t is None:
            return False
        return self.max_rows is None or (B * t <= self.max_rows and B <= CPU_MAX_DECODE_BATCH)

    @property
    def fusing(self) -> bool:
        """Whether steps that would compile run fused now (the model allows it and the switch is on)."""
        return self.fused is not None and fused.enabled

    def warm(self, Ts: list[int], rows: int) -> None:
        """Compile (or load from inductor's cache) the graphs that batch-1 steps of these token counts, and batched
        one-token steps, use, with one dummy step each, before a rollout's first step needs them: a graph first met
        mid-rollout cost that rollout 0.7 s (loaded) to 7 s (compiled), an exploring selector meeting several.
        Batched verify graphs (several rows of several tokens) compile on first use, which keeps a call's start as
        costly as before they compiled. The dummy KV lands in the trash block (no row holds a block yet). In
        inference mode, as the decode loop runs: dynamo guards on it, and a graph compiled outside it serves no step
        (every warmed graph compiled a second time at the first step)."""
        with torch.inference_mode():
            self._warm(Ts, rows)

    def _warm(self, Ts: list[int], rows: int) -> None:
        for t in sorted({bucket_for(T, self.t_buckets) for T in Ts} - {None}):
            for B in (1, 2) if rows > 1 and t == 1 else (1,):  # batched verify graphs compile on first use
                if (B > 1, t) in self.seen or not self.compiles(B, t) or t + 1 >= self.cache.length or self.fusing:
                    continue
                start = torch.full((B,), min(128, (self.cache.length - t) // 2), dtype=torch.long)
                self.run(torch.zeros(B, t, dtype=torch.long), start)

    def run(self, tokens, start, depths=None, tree_mask=None, hidden_layers=(), top=None):
        B, T = tokens.shape
        top = start_top(start, top)
        if self.fusing and B * T <= fused.MAX_TOKENS and top + T <= self.cache.length:
            self.counts["fused"] += 1
            return super().run(tokens, start, depths, tree_mask, hidden_layers, layer_call=self.fused, top=top)
        t = bucket_for(T, self.t_buckets)
        if top + (t or T) > self.cache.length or not self.compiles(B, t):
            self.counts["eager"] += 1
            return super().run(tokens, start, depths, tree_mask, hidden_layers, top=top)
        if t != T:
            tokens, start, depths, tree_mask = pad_batch(tokens, start, depths, tree_mask, B, t)
        self.counts["compiled"] += 1
        key = (B > 1, t)
        call = self.layer_call if key in self.seen else _marking(self.layer_call, B > 1)
        self.seen.add(key)
        logits, hiddens = super().run(tokens, start, depths, tree_mask, hidden_layers, layer_call=call, top=top)
        if t != T:
            logits, hiddens = logits[:, :T], {i: h[:, :T] for i, h in hiddens.items()}
        return logits, hiddens


def captured_layer_call():
    """The compiled layer call for CUDA graph captures (graphs.GraphPool), compiled with every activation dim
    symbolic, so one compile serves every batch bucket (B > 1; B = 1 specialises), token bucket and pool size
    (the pool is re-sized between rollouts). Only captures call it: a replay runs no Python.

    Why not static shapes with marks: FlexAttention stays outside these graphs (attention._flex_outside_graph),
    behind a graph break, and dynamo compiles the frames below a break on tensors the frame above made, which
    carry no marks: each batch bucket compiled them again (2 frames a bucket in the stand-in probe of
    tests/rollout/runtime/test_compiled_buckets.py), up to the recompile limit, and then ran eagerly."""
    return _marking(compiled_layer_call(dynamic=True), batched=True)


def _marking(call, batched: bool):
    """`call` after marking its inputs' batch (when batched) and context-length dims dynamic, so the
    first compile of a key is already general and no later step recompiles for a new B or S."""
    from torch._dynamo import maybe_mark_dynamic

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            return [obj]
        return [v for v in vars(obj).values() if isinstance(v, torch.Tensor)] if hasattr(obj, "__dataclass_fields__") else []

    def marked(layer, *args):
        fb = next((a for a in args if hasattr(a, "slots")), None)  # None: the head, whose input is x alone
        masks = ([fb.attn] if fb is not None else []) + [a for a in args if hasattr(a, "dense")]
        rows = next(a for a in args if isinstance(a, torch.Tensor)).shape[0]  # x [B, T, H] is the first tensor
        if batched:  # every [B, ...] input
            for x in [t for a in args + tuple(masks) for t in tensors(a)]:
                if x.dim() > 0 and x.shape[0] == rows:
                    maybe_mark_dynamic(x, 0)
        if fb is not None and fb.blocks is not None:
            maybe_mark_dynamic(fb.blocks, 1)
        for a in args:  # a layer's KV pools: their block count changes when the pool grows (kv_cache.py)
            if isinstance(a, torch.Tensor) and a._base is not None and a._base.dim() == 5:
                maybe_mark_dynamic(a, 0)
        for m in masks:
            if m.dense is not None:
                maybe_mark_dynamic(m.dense, 3)
        return call(layer, *args)

    return marked
