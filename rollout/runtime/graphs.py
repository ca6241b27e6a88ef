"""CUDA graphs for the target's step forward (decode and verify), behind an eager fallback with the same API.

`GraphPool` follows nano-vllm: one graph per bucket, one shared memory pool, static buffers sized for
the largest graph, largest batch captured first, and a replay pads to the smallest graph that fits.
A graph is keyed by (batch bucket b, T bucket t, hidden layers), never by context length:
  * b: 1, 2, 4, 8, then every 16 up to the cache's rows (and the row count itself).
  * t: tokens per row (1 = decode, 1 + nodes = verify): the token counts the selector's arms use
    (`use_sizes`, from the engine's calibration), so a verify of 4 drafts runs a 5-token graph, not an 8;
    any other count pads up to the next of those or of the powers of two <= max_t (`verify_buckets`).
  * hidden layers: EAGLE-3's features are static outputs too, captured on first request.
At 512 rows that is 36 x 5 graphs per hidden-layer set; keying by context length as well (powers of
two up to the cache length) multiplied that by 4-6 and made long rollouts capture all the time.
Only tokens, start, depths and tree mask are copied in (a few hundred bytes; a chain's depths and mask only
when the buffers held another layout, `GraphPool._load`); the attention mask is
built inside the graph from them (`build_step_batch`), over the whole cache length S. What a
graph then reads depends on the attention kernel (attention.py):
  * FlexAttention (CUDA): the block mask is built in the graph from each row's start, and the kernel
    reads only the KV blocks below start + t: reads follow the live context at any length, with no
    shape depending on it. This is the point of keying without context length.
  * dense fallback (no FlexAttention; the CPU `emulate` backend): a [b, 1, t, S] mask and every one of
    the S positions of every row are read whatever the mask says. Correct at any context length, but
    a step costs the full cache length in bandwidth: for SmolLM2 at 32 rows x 2048 positions, 1.5 GB
    of KV a step against 0.27 GB of weights. Eager steps (EagerRunner) read max(start) + T instead.

Why padding is harmless:
  * Padding rows B..b-1 run token 0 at start 0. Live sequences are compacted into block-table rows
    0..B-1 and rows B.. point at the trash block (kv_cache.py), so padding rows write and read only
    trash. Hence buckets never exceed the table's rows.
  * Padding nodes T..t-1 of a real row extend it as a chain: real nodes never see them (the tree mask
    is lower-triangular there) and they write past the row's length (into its own last block, or
    the trash block past its blocks), where no mask looks again. They need start + t <= cache length;
    otherwise the step runs eagerly.
  * Every op is row-independent, so real rows change only by batch-size-dependent float rounding.

Captures never synchronise the device or empty the allocator's cache (torch.cuda.graph() does both on
entry): a lazy capture mid-rollout only queues work, beside the drafter trainer's thread. Only
`capture_all` (eager_start, before any sequence is live) synchronises, once, to measure the pool.

Graphs hold raw addresses of the cache, RoPE tables and weights. Weight syncs copy in place and are
seen; a reallocated cache (which always comes with new RoPE tables) needs a new pool: `run` checks.
A pool that grew in place (kv_cache.PagedKVCache._grow_pool: new K/V tensors, same cache object, a new
`generation`) drops every graph, which are captured again as steps need them.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model.attention import BLOCK, step_mask, use_flex
from rlspec.rollout.runtime.model.llama import ForwardBatch, LlamaForCausalLM

WARMUP_RUNS = 2  # first calls pick kernels and allocate workspaces; a capture must not see that
MODES = ("auto", "off", "lazy", "eager_start")


# ---- pure bucket and padding logic -------------------------------------------------------------
def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... <= max_rows, then max_rows itself so no batch the cache holds goes eager."""
    out = [b for b in (1, 2, 4, 8) if b <= max_rows] + list(range(16, max_rows + 1, 16))
    return out if out[-1] == max_rows else out + [max_rows]


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """lo, 2*lo, 4*lo, ... below hi, then hi."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi]


def verify_buckets(max_t: int, sizes=()) -> list[int]:
    """Token buckets of the step graphs: the powers of two up to max_t (what a capped or unusual draft pads to)
    and every size in `sizes` <= max_t (1 + the draft nodes of each arm: those run exactly, unpadded)."""
    return sorted(set(pow2_buckets(1, max_t)) | {int(t) for t in sizes if 1 <= int(t) <= max_t})


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= n (buckets sorted ascending), or None when n is above them all."""
    return next((b for b in buckets if b >= n), None)


def pad_batch(tokens, start, depths, tree_mask, rows: int, T: int):
    """Pad a step of B rows x T0 tokens to [rows, T]; returns (tokens, start, depths, tree_mask) on
    tokens' device (inputs already on the GPU then load into a graph's buffers without a host copy).

    tokens [B, T0] long, start [B] long, depths [B, T0] long or None (chain), tree_mask [B, T0, T0]
    bool or None (chain). Out: tokens [rows, T], start [rows], depths [rows, T], tree_mask [rows, T, T].
    Padding rows: token 0, start 0, a chain. Padding nodes: a chain continuation (depth = index).
    """
    (B, T0), dev = tokens.shape, tokens.device
    out_tokens = torch.zeros(rows, T, dtype=torch.long, device=dev)
    out_tokens[:B, :T0] = tokens
    out_start = torch.zeros(rows, dtype=torch.long, device=dev)
    out_start[:B] = start
    out_depths = torch.arange(T, device=dev).repeat(rows, 1)
    if depths is not None:
        out_depths[:B, :T0] = depths
    # a chain is the tree whose mask is lower-triangular, so one graph serves chains and trees
    out_tree = torch.ones(T, T, dtype=torch.bool, device=dev).tril().repeat(rows, 1, 1)
    if tree_mask is not None:
        out_tree[:B, :T0, :T0] = tree_mask
    return out_tokens, out_start, out_depths, out_tree


def build_step_batch(tokens, start, cache: PagedKVCache, S: int, depths=None, tree_mask=None,
                     flex: bool = False, group: int = 1) -> ForwardBatch:
    """ModelRunner.step's ForwardBatch for rows 0..B-1, built on tokens' device with no host sync (so it
    can be captured).

    tokens [B, T], start [B] (cache entries each row holds), depths [B, T] RoPE offsets or None (chain),
    tree_mask [B, T, T] (node t may see node u) or None (chain); S >= max(start) + T: cache positions
    the attention spans, rounded up to whole blocks (the gather reads blocks); flex: FlexAttention's
    block mask (reads only live blocks) instead of a dense one; group: the model's query heads per KV head, which
    the flex mask folds into its query axis (attention._flex_mask).
    """
    B, T = tokens.shape
    # every layer's kernels read start side by side (a column of the host's packed transfer has a stride): one copy
    # here, not one a layer in paged_decode's
    start = start.contiguous()
    steps = torch.arange(T, device=tokens.device)
    offs = steps.expand(B, T) if depths is None else depths
    write = start[:, None] + steps
    slots = cache.step_slots(write)
    if flex and T <= BLOCK and cache.block_size == BLOCK:  # paged FlexAttention: no gather at all
        attn = step_mask(start, T, S, tree_mask, True, cache.table[:B], cache.k.shape[1] * BLOCK, group)
        return ForwardBatch(tokens, start[:, None] + offs, write, attn, slots)
    blocks = cache.blocks(B, S)
    S = blocks.shape[1] * cache.block_size
    return ForwardBatch(input_ids=tokens, positions=start[:, None] + offs, write_index=write,
                        attn=step_mask(start, T, S, tree_mask, flex, group=group), slots=slots, blocks=blocks)


def head_group(model) -> int:
    """Query heads per KV head: what the flex step mask folds into its query axis."""
    return model.cfg.num_heads // model.cfg.num_kv_heads


def start_top(start: torch.Tensor, top: int | None) -> int:
    """max(start): as the host knows it, else read from the tensor (a device-to-host sync on an accelerator)."""
    return int(start.max()) if top is None else top


def _to(x, device):
    return None if x is None else x.to(device)


# ---- runners ------------------------------------------------------------------------------------
class EagerRunner:
    """The step forward without graphs: on CPU, and for every shape a GraphPool did not capture."""

    fresh = False  # a GraphPool's last run captured its graph first (ModelRunner.step reads it)

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, device):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.flex = use_flex(self.device)

    def run(self, tokens, start, depths=None, tree_mask=None, hidden_layers=(), layer_call=None, top=None):
        """T new tokens for live rows 0..B-1; tokens [B, T], start [B] long; depths [B, T] and
        tree_mask [B, T, T] for trees. Returns (logits [B, T, V] float32, {layer: hidden [B, T, H]}).
        Dense attention reads max(start) + T positions: `top` = max(start) as the host knows it (None: read
        from start, a device-to-host sync); flex skips by block.
        layer_call: how each layer runs (the model's forward; compiled.py passes its compiled call)."""
        dev = self.device
        S = self.cache.length if self.flex else start_top(start, top) + tokens.shape[1]
        fb = build_step_batch(tokens.to(dev), start.to(dev), self.cache, S, _to(depths, dev), _to(tree_mask, dev),
                              self.flex, head_group(self.model))
        return self.model(fb, self.cache.k, self.cache.v, hidden_layers, layer_call=layer_call)

    def memory_bytes(self) -> int:
        return 0


class _StaticBuffers:
    """Flat buffers sized for the largest (batch, T); graph (b, t) views their contiguous prefix as [b, t, ...]."""

    def __init__(self, rows: int, max_t: int, vocab: int, hidden: int, dtype, device):
        n = rows * max_t
        self.hidden_size, self.vocab, self.dtype, self.device = hidden, vocab, dtype, device
        with torch.inference_mode(False):  # in-place copies into them must work outside inference mode
            self.tokens = torch.zeros(n, dtype=torch.long, device=device)
            self.depths = torch.zeros(n, dtype=torch.long, device=device)
            self.start = torch.zeros(rows, dtype=torch.long, device=device)
            self.tree = torch.zeros(n * max_t, dtype=torch.bool, device=device)
            self.logits = torch.zeros(n * vocab, dtype=torch.float32, device=device)
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> flat [rows * max_t * H], made on first request
        self.n = n

    def inputs(self, b: int, t: int):
        return (self.tokens[: b * t].view(b, t), self.start[:b], self.depths[: b * t].view(b, t),
                self.tree[: b * t * t].view(b, t, t))

    def load(self, b: int, t: int, padded) -> None:
        for dst, src in zip(self.inputs(b, t), padded):
            dst.copy_(src)

    def logits_view(self, b: int, t: int) -> torch.Tensor:
        return self.logits[: b * t * self.vocab].view(b, t, self.vocab)

    def hidden_view(self, layer: int, b: int, t: int) -> torch.Tensor:
        if layer not in self.hidden:
            with torch.inference_mode(False):
                self.hidden[layer] = torch.zeros(self.n * self.hidden_size, dtype=self.dtype, device=self.device)
        return self.hidden[layer][: b * t * self.hidden_size].view(b, t, self.hidden_size)

    def nbytes(self) -> int:
        bufs = [self.tokens, self.depths, self.start, self.tree, self.logits, *self.hidden.values()]
        return sum(x.numel() * x.element_size() for x in bufs)


class _CudaGraph:
    def capture(self, fn, pool, stream) -> None:
        """Warm up, then capture `fn` on `stream` into `pool`, without torch.cuda.graph()'s device
        synchronisation and cache emptying (see the module docstring)."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-ups on a side stream, as torch.cuda.graph's documentation asks
            for _ in range(WARMUP_RUNS):
                fn()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the online drafter trainer may issue CUDA calls from its own thread meanwhile
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def replay(self) -> None:
        self.graph.replay()


class _CallGraph:
    """CPU stand-in for a CUDA graph: replay re-runs the closure, which reads only the static buffers,
    so CPU tests exercise the pool's padding, bucketing and buffer plumbing. Its capture runs the closure's
    warm-ups as a CUDA capture does, so that a closure which changes its own inputs fails its tests here too."""

    def capture(self, fn, pool, stream) -> None:
        for _ in range(WARMUP_RUNS):
            fn()
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class GraphSet:
    """Keyed captures of closures over static buffers, one memory pool and one capture stream: the mechanism
    GraphPool uses for the target's steps, for other fixed-shape work (the EAGLE-3 drafter's levels,
    drafters/eagle3_graphs.py). backend "cuda" captures CUDA graphs; "emulate" replays by calling (CPU tests
    of the bookkeeping). `counts`: captures and replays."""

    def __init__(self, device, backend: str = "cuda"):
        if backend not in ("cuda", "emulate") or (backend == "cuda" and torch.device(device).type != "cuda"):
            raise ValueError(f"backend {backend!r} on device {device!s}: CUDA graphs need backend='cuda' on a "
                             "CUDA device; use backend='emulate' elsewhere (tests)")
        self.backend, self.device = backend, torch.device(device)
        cuda = backend == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.graphs: dict = {}
        self.counts = {"captures": 0, "replays": 0}

    def clear(self) -> None:
        """Forget every graph (what they read was reallocated), and their memory pool with them: a pool whose last
        graph is gone is released, and a capture into its old handle fails (CUDACachingAllocator's use_count
        assertion), so later captures take a new one."""
        self.graphs.clear()
        if self.backend == "cuda":
            self.pool = torch.cuda.graph_pool_handle()

    def replay(self, key, fn, keep=None) -> bool:
        """Replay the graph of `key`, capturing `fn` first when there is none; True when this call captured.
        keep: for a closure that changes what it reads (a draft level advances its hidden state), keep() saves
        that state and returns what puts it back, which runs between the capture's warm-ups and the replay."""
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = _CudaGraph() if self.backend == "cuda" else _CallGraph()
            restore = keep() if keep is not None else None
            graph.capture(fn, self.pool, self.stream)
            if restore is not None:
                restore()
            self.graphs[key] = graph
            self.counts["captures"] += 1
        graph.replay()
        self.counts["replays"] += 1
        return fresh


def _reserved_bytes(cuda: bool) -> int:
    """Bytes the CUDA caching allocator holds (a host-side counter: no synchronisation)."""
    return torch.cuda.memory_reserved() if cuda else 0


class GraphPool:
    """Captured step forwards over one KV cache; `run` has EagerRunner's API and falls back to it.

    capture_mode "lazy": capture a key the first time a step needs it, warming up on that step's own
    inputs (warm-up runs execute and write KV, so they must write exactly what the step writes).
    "eager_start": capture every (b, t) now, largest first; only while no sequence is live, since
    those warm-ups write positions 0..t-1 of rows 0..b-1. backend "emulate" replays by calling (tests).
    """

    fresh = False  # the last run captured its graph first: seconds that are no step's cost (ModelRunner.step)

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, device, capture_mode: str = "lazy",
                 max_rows: int | None = None, max_t: int = 16, hidden_layers=(), backend: str = "cuda",
                 layer_call=None):
        if capture_mode not in ("lazy", "eager_start"):
            raise ValueError(f"capture_mode must be 'lazy' or 'eager_start', got {capture_mode!r}")
        if backend not in ("cuda", "emulate") or (backend == "cuda" and torch.device(device).type != "cuda"):
            raise ValueError(f"backend {backend!r} on device {device!s}: CUDA graphs need backend='cuda' on a "
                             "CUDA device; use EagerRunner (or backend='emulate' in tests) elsewhere")
        self.model, self.cache, self.device, self.backend = model, cache, torch.device(device), backend
        self.layer_call = layer_call  # the compiled layer (runtime/compiled.py): graphs capture compiled kernels
        self.eager = EagerRunner(model, cache, device)
        self.flex = use_flex(self.device)  # decided once: every graph of the pool attends the same way
        self.batch_buckets = batch_buckets(min(max_rows or cache.rows, cache.rows))
        self.max_t = max_t
        self.t_buckets = verify_buckets(max_t)
        cfg = model.cfg
        self.static = _StaticBuffers(self.batch_buckets[-1], self.t_buckets[-1], cfg.vocab_size,
                                     cfg.hidden_size, model.lm_head.weight.dtype, self.device)
        self.graphs: dict[tuple, _CudaGraph | _CallGraph] = {}
        cuda = backend == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if cuda else None  # one capture stream for all graphs
        self.pool_bytes = 0
        self.counts = {"replays": 0, "captures": 0, "eager": 0}
        self.drops = 0  # times the pool grew under the graphs and they were dropped
        self._rope = model.rope_cos  # identity check: a new cache comes with new RoPE tables
        self._generation = cache.generation  # the pool's tensors the graphs were captured over
        self._chain = None  # the (b, t) whose chain depths and mask the static buffers hold (_load)
        if capture_mode == "eager_start":
            self.capture_all(hidden_layers)

    def use_sizes(self, sizes) -> None:
        """Give the token counts `sizes` (1 + draft nodes of each arm) graphs of their own: no verify pads
        to the next power of two. Graphs already captured stay valid (a key names its exact shape)."""
        self.t_buckets = verify_buckets(self.max_t, [*self.t_buckets, *sizes])

    def key_for(self, tokens, start, hidden_layers=(), top=None) -> tuple | None:
        """(b, t, hidden layers) of the graph that serves this step, or None to run eagerly."""
        B, T = tokens.shape
        b, t = bucket_for(B, self.batch_buckets), bucket_for(T, self.t_buckets)
        # padded nodes write up to start + t - 1, which must stay inside the cache
        if b is None or t is None or start_top(start, top) + t > self.cache.length:
            return None
        return b, t, tuple(sorted(hidden_layers))

    def run(self, tokens, start, depths=None, tree_mask=None, hidden_layers=(), top=None):
        """EagerRunner.run's contract -> (logits [B, T, V], {layer: [B, T, H]})."""
        if self.stale():
            raise RuntimeError("the KV cache and RoPE tables were reallocated after these graphs were captured; "
                               "build a new GraphPool over the new cache (ModelRunner.ensure_cache should)")
        if self.cache.generation != self._generation:
            self._drop_graphs()
        key = self.key_for(tokens, start, hidden_layers, top)
        self.fresh = False
        if key is None:
            self.counts["eager"] += 1
            return self.eager.run(tokens, start, depths, tree_mask, hidden_layers, top=top)
        b, t, _ = key
        self._load(b, t, tokens, start, depths, tree_mask)
        self.fresh = key not in self.graphs
        graph = self.graphs.get(key) or self._capture(key)
        graph.replay()
        self.counts["replays"] += 1
        B, T = tokens.shape
        # clones: the next replay overwrites the static outputs
        logits = self.static.logits_view(b, t)[:B, :T].clone()
        return logits, {i: self.static.hidden_view(i, b, t)[:B, :T].clone() for i in hidden_layers}

    def _load(self, b: int, t: int, tokens, start, depths, tree_mask) -> None:
        """Copy a step's inputs into the (b, t) graph's buffers. A tree goes through pad_batch. A chain copies
        its tokens and starts and zeroes the padding rows' starts (2-3 launches where pad_batch takes 13: on a
        GPU a launch is ~5 us of host time the device waits through between a speculative step's read and the
        next verify). Its depths and mask are the same every step (node j at depth j, lower-triangular), so
        they are written only when the shared buffers last held another layout (`_chain`). Padding tokens keep
        what the buffers held (token ids, all of them): their nodes and rows write only past the rows'
        lengths or into the trash block, and no output of theirs is read (module docstring)."""
        if depths is not None or tree_mask is not None:
            self.static.load(b, t, pad_batch(tokens, start, depths, tree_mask, b, t))
            self._chain = None
            return
        dst_tokens, dst_start, dst_depths, dst_tree = self.static.inputs(b, t)
        if self._chain != (b, t):
            empty = torch.zeros(0, t, dtype=torch.long, device=self.device)
            _, _, chain_depths, chain_tree = pad_batch(empty, empty[:, 0], None, None, b, t)
            dst_depths.copy_(chain_depths)
            dst_tree.copy_(chain_tree)
            self._chain = (b, t)
        B, T = tokens.shape
        dst_tokens[:B, :T].copy_(tokens)
        dst_start[:B].copy_(start)
        if B < b:  # padding rows start at 0: start + t stays inside the cache
            dst_start[B:].zero_()

    def stale(self) -> bool:
        """The RoPE tables were reallocated after these graphs were captured (they hold the old addresses)."""
        return self.model.rope_cos is not self._rope

    def _drop_graphs(self) -> None:
        """The pool grew (new K/V addresses and a longer paged-attention sequence): forget every graph and
        their memory pool; steps capture again on demand (lazily, whatever the capture mode)."""
        self.graphs.clear()
        if self.backend == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        self.pool_bytes = 0
        self.drops += 1
        self._generation = self.cache.generation

    def capture_all(self, hidden_layers=()) -> None:
        """Capture every bucket, largest batch first so that smaller graphs reuse its pool blocks.
        Runs before any sequence is live, so it may synchronise once to measure the pool exactly."""
        cuda = self.backend == "cuda"
        if cuda:  # drop blocks cached outside the pool so that the reserved delta is the pool's
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        before, self.pool_bytes = _reserved_bytes(cuda), 0
        hl = tuple(sorted(hidden_layers))
        for b in reversed(self.batch_buckets):
            for t in reversed(self.t_buckets):
                if (b, t, hl) not in self.graphs:
                    empty = torch.zeros(0, t, dtype=torch.long, device=self.device)
                    self._load(b, t, empty, empty[:, 0], None, None)  # every row padding: starts 0, a chain
                    self._capture((b, t, hl))
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.pool_bytes = _reserved_bytes(cuda) - before

    def _capture(self, key: tuple):
        b, t, hl = key
        tokens, start, depths, tree = self.static.inputs(b, t)
        logits_out = self.static.logits_view(b, t)
        hidden_out = {i: self.static.hidden_view(i, b, t) for i in hl}  # allocated before capture
        model, cache, flex, layer_call = self.model, self.cache, self.flex, self.layer_call

        def forward():  # reads and writes only static buffers, the cache and the weights
            with torch.inference_mode():
                fb = build_step_batch(tokens, start, cache, cache.length, depths, tree, flex, head_group(model))
                logits, hiddens = model(fb, cache.k, cache.v, hl, layer_call=layer_call, float_logits=False)
                logits_out.copy_(logits)  # float32 as it is copied
                for i in hl:
                    hidden_out[i].copy_(hiddens[i])

        cuda = self.backend == "cuda"
        graph = _CudaGraph() if cuda else _CallGraph()
        before = _reserved_bytes(cuda)
        graph.capture(forward, self.pool, self.stream)
        self.pool_bytes += _reserved_bytes(cuda) - before
        self.graphs[key] = graph
        self.counts["captures"] += 1
        return graph

    def memory_bytes(self) -> int:
        """Static buffers plus the shared pool: exact after capture_all; after lazy captures, the growth
        of reserved CUDA memory across them, an upper bound (warm-up blocks cached outside the pool)."""
        return self.static.nbytes() + self.pool_bytes


def make_step_runner(model: LlamaForCausalLM, cache: PagedKVCache, device, mode: str = "auto", layer_call=None,
                     **pool_kwargs):
    """A GraphPool on CUDA unless mode is "off"; EagerRunner elsewhere.

    mode: "auto" (= "lazy" on CUDA), "off", "lazy" or "eager_start"; layer_call: how the captured
    forwards run each layer (runtime/compiled.py's compiled call); pool_kwargs go to GraphPool.
    """
    if mode not in MODES:
        raise ValueError(f"graph mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    if mode == "off" or device.type != "cuda" or not torch.cuda.is_available():
        return EagerRunner(model, cache, device)
    return GraphPool(model, cache, device, "lazy" if mode == "auto" else mode, layer_call=layer_call, **pool_kwargs)
