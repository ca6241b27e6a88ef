"""ModelRunner: turns the engine's plain-Python batch description into tensors and runs the target.

The only engine part that touches tensors besides sampling/verification. Owns the model and the
paged KV cache (sized by a KVBudget); knows nothing of sequences, drafters or strategies.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from rlspec.rollout.runtime import device as device_sync
from rlspec.rollout.runtime.compiled import CompiledRunner, captured_layer_call, resolve_compile
from rlspec.rollout.runtime.graphs import MODES, EagerRunner, GraphPool, make_step_runner
from rlspec.rollout.runtime.kv_budget import KVBudget, step_reserve_bytes, total_memory_bytes
from rlspec.rollout.runtime.kv_cache import PagedKVCache, SideSpec, block_bytes, side_bytes
from rlspec.rollout.runtime.model.attention import BLOCK, causal_mask, use_flex
from rlspec.rollout.runtime.model.linear import pack_linears, refresh_linears
from rlspec.rollout.runtime.model.llama import ForwardBatch, LlamaForCausalLM
from rlspec.rollout.runtime.transfers import Transfers


KEEP_KV_FRACTION = 0.25  # a pool and its graphs up to this share of the device's memory stay across rollouts


class ModelRunner:
    """keep_kv_fraction: `release` keeps a pool with CUDA graphs over it while pool and graphs take at most this
    share of the device's memory (0: always give it back); see release. reserves: bytes by name that a growing
    pool leaves free on CUDA beside the steps' own (kv_budget.step_reserve_bytes), e.g. "drafter":
    DrafterTrainer.memory_bytes()."""

    def __init__(self, model: LlamaForCausalLM, device, dtype: torch.dtype, graph_mode: str = "auto",
                 max_graph_t: int = 16, budget: KVBudget | None = None, compile_mode: str = "auto",
                 keep_kv_fraction: float = KEEP_KV_FRACTION):
        if graph_mode not in MODES:  # fail at construction, not at the first generate()
            raise ValueError(f"graph_mode must be one of {MODES}, got {graph_mode!r}")
        self.compiled = resolve_compile(compile_mode, device, dtype)
        pack_linears(model, blocked=self.compiled)  # CPU bf16: the weights' fast copies (model/linear.py)
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.graph_mode, self.max_graph_t = graph_mode, max_graph_t
        self.budget = budget or KVBudget()
        self.cache: PagedKVCache | None = None
        self.steps = None  # EagerRunner or GraphPool over self.cache; rebuilt with it
        self.kv_peak_blocks = 0  # most blocks the last released pool held: where a growing pool starts
        self.fresh = False  # the last step compiled or captured (step)
        self.keep_kv_fraction = keep_kv_fraction
        self.kept_bytes = 0  # what the last release kept on the device (pool + graphs): given up by the update
        self.reserves: dict[str, int] = {}
        self.transfers = Transfers(self.device)  # every copy of the decode loop between host and device

    def ensure_cache(self, rows: int, length: int, extra_layers: int = 0, min_positions: int = 0,
                     side: SideSpec | None = None) -> PagedKVCache:
        """Allocate once; rebuild only when a call needs more table rows or positions than ever before (or
        another drafter layer count or side buffers). The pool's size comes from the budget (kv_budget.py),
        which counts the side buffers' bytes per block too; min_positions is the longest sequence the call
        needs, which the pool must hold. By default the pool grows with the call's tokens (kv_cache.set_ceiling)."""
        layers = self.model.cfg.num_layers + extra_layers
        side = dict(side or {})
        old = self.cache
        # paged FlexAttention maps its 128-position blocks one to one onto the pool's blocks; the budget then
        # counts in those blocks (counting in its own 16-position ones asked 8x the positions: gpu-check)
        bs = BLOCK if use_flex(self.device) else self.budget.block_size
        budget = dataclasses.replace(self.budget, block_size=bs)
        reserve = self.reserve_bytes(max(rows, old.rows if old else 0))
        if old is not None and old.fits(rows, length) and old.layers == layers and old.side_spec == side \
                and old.block_size == bs and old.refit(budget, max(min_positions, 1), self.device, reserve):
            if isinstance(self.steps, GraphPool) and self.steps.stale():  # a kept pool's graphs, RoPE since grown
                self.steps = self._step_runner()
            return old
        rows = max(rows, old.rows if old else 0)
        length = max(length, old.length if old else 0)
        if use_flex(self.device):  # FlexAttention reads whole 128-position blocks: no ragged last one
            length = -(-length // BLOCK) * BLOCK
        self.release()  # graphs hold the old cache/RoPE addresses: drop them, and the old pool, first
        del old
        per_block = block_bytes(self.model.cfg, layers, bs, self.dtype) + side_bytes(side, bs)
        size = budget.pool_size(per_block, rows, length, max(min_positions, 1), self.device, self.kv_peak_blocks,
                                reserve_bytes=reserve)
        self.cache = PagedKVCache(self.model.cfg, rows, length, size.blocks, bs, self.dtype, self.device, extra_layers,
                                  side)
        self.cache.set_ceiling(size.max_blocks, budget.ceiling_headroom(self.device, reserve))
        self.cache.to_device, self.cache.to_host = self.transfers.to_device, self.transfers.to_host
        self.model.init_rope(self.cache.length)
        self.steps = self._step_runner()
        return self.cache

    def _step_runner(self):
        """Graphs (CUDA), compiled or eager steps over the current cache and RoPE tables."""
        steps = make_step_runner(self.model, self.cache, self.device, self.graph_mode,
                                 captured_layer_call() if self.compiled else None, max_t=self.max_graph_t)
        if self.compiled and type(steps) is EagerRunner:  # no CUDA graphs: compiled steps on their own
            steps = CompiledRunner(self.model, self.cache, self.device)
        return steps

    def warm(self, Ts: list[int], rows: int) -> None:
        """Compile ahead every step graph that steps of these token counts (1 + each draft size) will use; a
        graph pool gives each count a graph of its own (no padding to a power of two)."""
        if isinstance(self.steps, GraphPool):
            self.steps.use_sizes(Ts)
        if isinstance(self.steps, CompiledRunner):
            self.steps.warm(Ts, rows)

    def synchronize(self) -> None:
        """Wait for every step queued on the device (runtime/device.py): timings that feed a decision call it."""
        device_sync.synchronize(self.device)

    def refresh_weights(self) -> None:
        """Bring the weights' packed copies up to date (a sync or an in-place update may have changed them);
        once per generate call: compiled steps cannot check them (model/linear.py)."""
        refresh_linears(self.model)

    def reserve_bytes(self, rows: int) -> int:
        """What a growing pool leaves free on CUDA (docs/runtime.md#memory-plan): the steps' graphs and verify
        buffers at `rows` rows, plus `reserves`; nothing elsewhere (no graphs; host memory is the CPU's limit)."""
        if self.device.type != "cuda":
            return 0
        return step_reserve_bytes(self.model.cfg, rows, self.max_graph_t, self.dtype) + sum(self.reserves.values())

    def release(self, keep: bool = False) -> bool:
        """Give the pool (and the graphs over it) back, e.g. to the policy update between rollouts; the next
        ensure_cache allocates again. Returns whether it did.

        keep (the engine's release at the end of a rollout): a pool with CUDA graphs over it stays while pool and
        graphs take at most keep_kv_fraction of the device's memory (kept_bytes: what the update then goes
        without): the graphs hold the pool's addresses, so a new pool meant ~2 warm-ups and a capture per bucket
        in every rollout; a kept one captures nothing new once the rollouts stop growing it
        (docs/runtime.md#graphs-across-rollouts). Without keep (release_kv, a pool holding non-finite values)
        it always goes."""
        if self.cache is not None:
            self.kv_peak_blocks = self.cache.alloc.stats.peak_used
        held = 0 if self.cache is None else self.cache.nbytes() + self.steps.memory_bytes()
        self.kept_bytes = held if keep and self._keeps(held) else 0
        if not self.kept_bytes:
            self.steps = None
            self.cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return not self.kept_bytes

    def _keeps(self, held: int) -> bool:
        return isinstance(self.steps, GraphPool) and held <= self.keep_kv_fraction * total_memory_bytes(self.device)

    def prefill(self, prompts: list[list[int]], rows: list[int], hidden_layers=()):
        """Fresh prompts into the given rows, whose blocks cover them; returns (last-token logits [P, V],
        hiddens).

        Prompts are right-padded to the longest, T; attention is causal among the new tokens
        (attention.attend_causal), so no [P, T, T] mask is built anywhere, and padding positions write
        to the trash block.
        """
        P, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(P, T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        pos = torch.arange(T, device=self.device).expand(P, T)
        slots = self.cache.slots(torch.tensor(rows, device=self.device), torch.where(pos < lens[:, None], pos, -1))
        fb = ForwardBatch(input_ids=ids.to(self.device), positions=pos, write_index=pos, attn=causal_mask(),
                          slots=slots)
        return self.model(fb, self.cache.k, self.cache.v, hidden_layers, logits_index=lens - 1)

    def step(self, tokens: torch.Tensor, start: torch.Tensor, depths=None, tree_mask=None, hidden_layers=(),
             top: int | None = None):
        """T new tokens for each live row 0..B-1 whose cache holds `start[b]` entries.

        tokens [B, T] long; start [B] long. A chain by default; a tree passes depths [B, T]
        (RoPE offsets) and tree_mask [B, T, T] bool (node t may see node s); top: max(start) as the host knows it
        (None: read from start, which syncs an accelerator). Returns
        (logits [B, T, V] float32, hiddens). On CUDA a captured graph replays when one fits.
        Sets `fresh` when dynamo compiled (a shape's first use, a recompile: compiled layers, FlexAttention) or
        a CUDA graph was captured during the step: seconds that are no step's cost, which the selectors' cost
        model must not learn (rollout/engine.py).
        """
        frames = compiled_frames()
        out = self.steps.run(tokens, start, depths, tree_mask, hidden_layers, top=top)
        self.fresh = self.steps.fresh or compiled_frames() != frames
        return out


def compiled_frames() -> int:
    """How many frames dynamo has compiled in this process (first compiles and recompiles alike); 0 while
    dynamo was never imported, which then costs nothing to ask."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["frames"]["ok"] if utils is not None else 0
