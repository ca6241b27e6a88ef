"""Attention over the KV cache: one entry point (`attend`), its kernel chosen by device in one place.

Two kinds of forward attend differently:
  * prefill of fresh right-padded prompts: causal self-attention among the T new tokens. A real
    token only ever sees earlier real tokens under a plain causal mask (padding sits to its right),
    so no per-row lengths and no mask tensor are needed: SDPA with is_causal (flash on CUDA).
    Padding queries see padding keys; their outputs and cache entries are never read.
  * a step (decode T=1, chain verify T=k+1, tree verify T=nodes): row b's T new tokens see its
    start[b] cached entries and, among themselves, what the tree mask allows (a chain is the
    lower-triangular tree). Their keys sit at cache positions start[b] .. start[b] + T - 1.

Kernels for a step, picked by `use_flex` when the step's mask is built (`step_mask`):
  * dense (CPU, and the reference): a [B, 1, T, S] boolean mask built on the device once per
    forward, then two grouped matmuls when queries are few (on CPU 6x faster than SDPA: 0.11 vs
    0.73 ms per layer at batch 8, SmolLM2; softmax in float32), SDPA otherwise. Reads S positions
    of every row whatever the mask says.
  * flex (CUDA): FlexAttention, compiled, with a BlockMask built on the device from per-row lengths.
    KV blocks of 128 positions wholly inside a row's context are `full` (no mask evaluated), the one
    or two blocks holding the new tokens are `partial` (mask_mod applies the tree), blocks past
    start + T are never read. Scores are never materialised and reads scale with each row's live
    context, not with S; building the mask needs no host sync, so CUDA graphs capture it.
  * paged (CPU, bf16, where our kernel is built): a step's keys and values read in place from the layer's pool
    through the block table, the dense mask deciding what each query sees (model/kernels/paged_attention.cpp).
    It needs the pool, not gathered keys, so llama.Attention calls it before any gather; `attend` serves the rest.
  * paged decode (CUDA, where Triton is installed): our Triton kernel (paged_decode.py) reads the pool in place
    through the rows' block tables, each row's context split into chunks that fill the GPU (flash-decoding), from
    the mask's start, tree and table alone (no BlockMask). It is the default for paged steps on CUDA; FlexAttention
    serves them where it is switched off (`paged_kernel`, RLSPEC_PAGED_ATTENTION=flex) or failed once here.
`attend_dense` is the reference; tests compare `attend_flex` with it (on CPU through torch.compile's
CPU backend, which also runs FlexAttention).

Sliding-window layers (Mistral, Qwen2's upper layers, Gemma 2/3's local layers) attend through `dense_view`:
the forward's mask with every key `window` or more positions behind its query hidden, transformers' rule
(masking_utils.sliding_window_overlay: key position > query position - window), on the dense kernel on CPU and
CUDA alike. FlexAttention's block mask is not reused for them: it marks whole blocks below each row's start
`full` (never masked), and a window cuts through those. Gemma 2's attention soft-capping also goes dense (the
scores must be capped before the softmax, which SDPA and the flex call here do not do).
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlspec.rollout.runtime.kv_cache import gather_blocks

BLOCK = 128  # FlexAttention's sparse block: KV is read or skipped 128 positions at a time
FEW_QUERIES = 32  # at most this many queries per row, the CPU's grouped matmuls beat SDPA
RECOMPILE_LIMIT = 64  # one compile per (query bucket, batch 1 or dynamic, dtype, cache length)
_flex_error: list[str] = []  # the first FlexAttention failure in this process: later steps go dense
# which kernel serves paged steps on CUDA: "triton" (paged_decode.py) or "flex"; benchmarks switch it to compare
paged_kernel = os.environ.get("RLSPEC_PAGED_ATTENTION", "triton")
_paged_error: list[str] = []  # the first failure of the Triton kernel here: later steps' masks are flex ones


@dataclass
class AttnMask:
    """What the new tokens of one forward may see, built on the device once and shared by all layers.

    causal: prefill; self-attention among the new tokens, causal (no tensors).
    kv_len: S, cache positions the step reads (the dense path's key length; the full cache for flex).
    start [B] long: cache entries each row holds before the new tokens.
    tree [B, t, t] bool or None (a chain, dense path): node i may see node j; flex pads t up to a
      power of two with rows and columns of False.
    dense [B, 1, T, S] bool (True = may attend) on the dense path; block: the BlockMask on the flex path.
    table [B, max_blocks] long: the rows' block tables on the paged flex path, whose BlockMask indexes
      the pool's physical blocks (keys/values are the whole pool, attend_flex's fallback gathers).
    group: query heads per KV head that the flex block mask folds into its query axis (attend_flex).
    paged: the Triton kernel serves the step (`attend_paged`) from start, tree (None: a chain) and table.
    """

    causal: bool = False
    kv_len: int | None = None
    start: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    block: object | None = None
    table: torch.Tensor | None = None
    captured: tuple = ()  # other [B, ...] tensors mask_mod reads (marked dynamic in batch like the rest)
    group: int = 1
    paged: bool = False


def causal_mask() -> AttnMask:
    return AttnMask(causal=True)


def use_flex(device) -> bool:
    """The one device dispatch: FlexAttention on CUDA (unless it failed once here), dense elsewhere."""
    return torch.device(device).type == "cuda" and not _flex_error and _flex_available()


def use_paged_decode(device) -> bool:
    """Whether the Triton kernel serves paged steps here: CUDA, Triton installed, chosen (`paged_kernel`), and
    it has not failed in this process."""
    return (torch.device(device).type == "cuda" and paged_kernel == "triton" and not _paged_error
            and triton_available())


def triton_available() -> bool:
    return _importable("triton")


def _flex_available() -> bool:
    return _importable("torch.nn.attention.flex_attention")


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def kernel_failed(errors: list[str], exc: Exception, kernel: str, then: str) -> None:
    """Record a kernel's failure in `errors` (the process's record, which its dispatch reads) and warn, naming the
    first failure and what serves from then on."""
    errors.append(f"{type(exc).__name__}: {exc}")
    warnings.warn(f"{kernel} failed ({errors[0][:300]}); {then}", RuntimeWarning, stacklevel=3)


def with_fallback(kernel, reference, errors: list[str], name: str, then: str):
    """A call of `kernel` that, where it fails (a compile or launch failure; running out of memory is raised),
    records the failure in `errors` (which the kernel's dispatch reads, so the reference serves from then on),
    warns once and returns the reference's result for the same arguments. Keyword arguments are the kernel's launch
    options: a call with them that fails raises (a depth whose shared memory the device lacks is its caller's to
    drop; the kernel at its defaults still serves)."""
    def call(*args, **launch):
        try:
            return kernel(*args, **launch)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reference computes the same
            if launch:
                raise
            kernel_failed(errors, exc, name, then)
            return reference(*args)
    return call


def flex_error() -> str | None:
    """Why FlexAttention was given up in this process (None while it works or was never tried)."""
    return _flex_error[0] if _flex_error else None


def step_mask(start: torch.Tensor, T: int, S: int, tree: torch.Tensor | None = None,
              flex: bool = False, table: torch.Tensor | None = None, pool_len: int = 0, group: int = 1) -> AttnMask:
    """The mask of a step; no host sync, so it can be built inside a CUDA graph.

    start [B] long on the target device; T new tokens per row; S >= max(start) + T positions read;
    tree [B, T, T] bool or None (a chain). flex: build a BlockMask (reads only live blocks); with
    table [B, max_blocks] (blocks of BLOCK positions) it indexes the physical blocks of a paged pool of
    pool_len positions; group: the model's query heads per KV head (the flex mask's query axis holds them all).
    """
    if flex and T <= BLOCK and table is not None and use_paged_decode(start.device):
        return AttnMask(kv_len=S, start=start, tree=tree, table=table, group=group, paged=True)
    if flex and T <= BLOCK:
        if tree is None:
            tree = torch.ones(T, T, dtype=torch.bool, device=start.device).tril().repeat(start.shape[0], 1, 1)
        return _flex_mask(start, T, S, tree, table, pool_len, group)
    return AttnMask(kv_len=S, start=start, tree=tree, dense=dense_step_mask(start, T, S, tree))


def dense_view(mask: AttnMask, positions: torch.Tensor, window: int | None = None) -> AttnMask:
    """The same forward's mask as a dense one, keeping only keys less than `window` positions behind each query
    when a window is given; no host sync (CUDA graphs capture it). positions [B, T]: the new tokens' positions
    (RoPE positions: a tree node's is start + its depth, so a node's window counts its ancestors, not its
    siblings' cache slots). Context keys sit at their own positions; the new keys at their nodes'.

    A prefill stays `causal` (the keys are the new tokens themselves); a step's keys are gathered densely:
    through the step's blocks, or on the paged flex path through `table` (the rows' blocks up to kv_len)."""
    B, T = positions.shape
    if mask.causal:
        keep = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()[None]  # [1 or B, T, T]
        if window is not None:
            keep = keep & ((positions[:, :, None] - positions[:, None, :]) < window)
        return AttnMask(causal=True, dense=keep[:, None])
    S, start = mask.kv_len, mask.start
    base = mask.dense if mask.dense is not None else dense_step_mask(start, T, S, mask.tree)
    table = mask.table[:, : S // BLOCK] if mask.table is not None else None
    tree = None if mask.tree is None else mask.tree[:, :T, :T]
    if window is None:
        return AttnMask(kv_len=S, start=start, tree=tree, dense=base, table=table)
    cols = torch.arange(S, device=start.device)
    rel = cols[None, :] - start[:, None]  # [B, S]: key index among the new tokens (negative: context)
    new = (rel >= 0) & (rel < T)
    key_pos = torch.where(new, positions.gather(1, rel.clamp(0, T - 1)), cols[None, :])
    near = (positions[:, :, None] - key_pos[:, None, :]) < window  # [B, T, S]
    return AttnMask(kv_len=S, start=start, tree=tree, dense=base & near[:, None], table=table)


def dense_step_mask(start: torch.Tensor, T: int, S: int, tree: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, T, S] bool: context (key < start) always visible, new keys by the tree (None: a chain)."""
    B, dev = start.shape[0], start.device
    rel = torch.arange(S, device=dev)[None, :] - start[:, None]  # key index minus start: [B, S]
    rel_q = rel[:, None, :].expand(B, T, S)
    if tree is None:
        new_ok = (rel_q >= 0) & (rel_q <= torch.arange(T, device=dev)[None, :, None])
    else:
        seen = tree[:, :T, :T].gather(2, rel_q.clamp(0, T - 1))  # [B, T, S]
        new_ok = seen & (rel_q >= 0) & (rel_q < T)
    return ((rel_q < 0) | new_ok)[:, None]


def _flex_mask(start: torch.Tensor, T: int, S: int, tree: torch.Tensor, table: torch.Tensor | None = None,
               pool_len: int = 0, group: int = 1) -> AttnMask:
    """BlockMask over the whole cache row (KV_LEN = S), queries padded to t = next power of two so
    that few shapes compile. Blocks 0 .. start//BLOCK - 1 are full; the partial ones follow.

    Grouped heads (group > 1): the query axis holds the group's heads one after another (group * t queries per
    KV head; query q is new token q % t), so one program reads a KV block once for all the heads that share it.
    With torch's own GQA every query head reads the whole context: a 7B step at 8k positions and batch 32 read
    its KV 7 times (the `contexts` rows of bench_out/gpu_2026-11-30/). Every query of a row sees the same KV blocks, so
    each query block gets the same block lists.

    Paged (table given): the same logical blocks, mapped through each row's table to physical blocks
    of the pool (KV_LEN = the pool's positions), as torch's PagedAttention does. mask_mod gets
    physical key indices; only the one or two partial blocks are evaluated, so a physical block is
    logical block `full` if it is the row's table[full], else `full + 1`."""
    from torch.nn.attention.flex_attention import BlockMask

    B, dev = start.shape[0], start.device
    t = 1 << (T - 1).bit_length()
    Q = group * t
    q_blocks = -(-Q // BLOCK)
    tree = tree.contiguous()
    if t != T:  # padding queries see the context only; their outputs are dropped
        tree = F.pad(tree, (0, t - T, 0, t - T))
    n_blocks = -(-S // BLOCK)
    full = start // BLOCK
    end = ((start + t + BLOCK - 1) // BLOCK).clamp(max=n_blocks)
    blocks = torch.arange(n_blocks, device=dev, dtype=torch.int32)
    partial_idx = (full[:, None].int() + blocks[None]).clamp(max=n_blocks - 1)
    full_idx = blocks.expand(B, n_blocks)

    def mask_mod(b, h, q, kv):
        rel = kv - start[b]
        return (rel < 0) | ((rel < t) & tree[b, q % t, rel.clamp(0, t - 1)])

    def per_q_block(x):  # [B, ...] -> [B, 1, q_blocks, ...]: the same lists for every query block
        return x[:, None, None].expand(B, 1, q_blocks, *x.shape[1:]).contiguous()

    if table is None:
        block = BlockMask.from_kv_blocks(
            per_q_block((end - full).int()), per_q_block(partial_idx), per_q_block(full.int()),
            per_q_block(full_idx), BLOCK, mask_mod, (Q, S))
        return AttnMask(kv_len=S, start=start, tree=tree, block=block, group=group)
    width = table.shape[1]
    first = table.gather(1, full.clamp(max=width - 1)[:, None])[:, 0]  # physical block of logical `full`

    def paged_mask_mod(b, h, q, kv):
        logical = torch.where(kv // BLOCK == first[b], full[b], full[b] + 1) * BLOCK + kv % BLOCK
        return mask_mod(b, h, q, logical)

    phys = table[:, :n_blocks]
    # the kernels want index rows at least as wide as KV_LEN in blocks (torch's PagedAttention pads them
    # the same way); entries past each row's count are never read. A pool smaller than a table row
    # (a tight budget) leaves them as they are
    pad = max(0, pool_len // BLOCK - n_blocks)

    def indices(logical):
        return per_q_block(F.pad(phys.gather(1, logical.long()).int(), (0, pad)))

    block = BlockMask.from_kv_blocks(per_q_block((end - full).int()), indices(partial_idx),
                                     per_q_block(full.int()), indices(full_idx), BLOCK, paged_mask_mod,
                                     (Q, pool_len), compute_q_blocks=False)
    return AttnMask(kv_len=S, start=start, tree=tree, block=block, table=table, captured=(first, full), group=group)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, scale: float | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KV, S, D] (grouped KV heads) -> [B, H, T, D] in q's dtype. scale: the score
    scaling (None: D ** -0.5); softcap: tanh soft-capping of the scores (never with a flex block mask)."""
    if mask.dense is not None:  # a dense step, or any forward's dense view (a sliding window)
        return attend_dense(q, k, v, mask.dense, scale, softcap)
    if mask.causal:
        return attend_causal(q, k, v, scale, softcap)
    if torch.compiler.is_compiling():
        return _flex_outside_graph()(q, k, v, mask, scale)
    return attend_flex(q, k, v, mask, scale)


def _flex_outside_graph():
    """attend_flex from inside a compiled layer (runtime/compiled.py), behind a graph break. Traced into the
    layer, FlexAttention's block mask carries the paged pool's length as Python ints, which the layer graph
    (compiled with static shapes) specialised on: every new pool size compiled each captured shape again (3-8
    s each on an H100; docs/gpu.md). Out here flex compiles on its own, once per query
    bucket and dtype, its KV length dynamic from the second size on, and the layer's graphs take any pool size.
    Made where it is called, while Dynamo traces (Dynamo is loaded then): torch.compiler.disable imports it (~2 s),
    which a process that never compiles (the drafter trainer's child, a CPU rollout) need not pay at import. Not
    cached: Dynamo traces through a cache's wrapper anyway, and warns that it did."""
    return torch.compiler.disable(attend_flex)


def attend_paged_dense(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, mask: AttnMask,
                       scale: float | None = None) -> torch.Tensor:
    """What attend_paged computes, densely over the rows' gathered blocks (its fallback, and the kernel counts'
    stand-in for it: rlspec/bench/kernels.py)."""
    T, S = q.shape[2], mask.kv_len
    k, v = (gather_blocks(x, mask.table[:, : S // x.shape[1]]) for x in (k_pool, v_pool))
    return attend_dense(q, k, v, dense_step_mask(mask.start, T, S, mask.tree), scale)


def _paged_kernel(q, k_pool, v_pool, mask: AttnMask, scale: float | None = None) -> torch.Tensor:
    return _paged_decode()(q, k_pool, v_pool, mask.table, mask.start, mask.tree, scale)


# attend_paged(q, k_pool, v_pool, mask, scale): a paged step (mask.paged) through the Triton kernel, q [B, H, T, D]
# over one layer's pools [num_blocks, BLOCK, KV, D] read in place through mask.table; where the kernel fails (this GPU
# or Triton cannot compile it), the dense result for that step and flex masks from then on (use_paged_decode)
attend_paged = with_fallback(_paged_kernel, attend_paged_dense, _paged_error, "the Triton paged decode kernel",
                             "paged steps attend through FlexAttention from now on")


@functools.cache
def _paged_decode():
    """paged_decode.paged_decode, behind a graph break inside a compiled layer (runtime/compiled.py): the kernel
    launches as it is, as FlexAttention does (_flex_outside_graph)."""
    from rlspec.rollout.runtime.model.paged_decode import paged_decode

    return torch.compiler.disable(paged_decode)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Prefill: q [B, H, T, D] over k/v [B, KV, T, D] of the same tokens, causally."""
    T, H, KV = q.shape[2], q.shape[1], k.shape[1]
    if (q.device.type == "cpu" and T <= FEW_QUERIES) or softcap is not None:
        tril = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return attend_dense(q, k, v, tril[None, None], scale, softcap)
    if q.device.type == "cuda" and H != KV and q.dtype == torch.float32:
        # flash (GQA-capable) takes only half types; the memory-efficient kernel wants equal heads
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != k.shape[1], scale=scale)


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """The reference. mask [B or 1, 1, T, S] bool. Grouped matmuls for few queries on CPU (and wherever scores
    are soft-capped, transformers' eager order: scale, cap, mask, float32 softmax), else SDPA."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    if softcap is None and (q.device.type != "cpu" or T > FEW_QUERIES):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != KV, scale=scale)
    G = H // KV
    fused = torch.compiler.is_compiling() and q.device.type == "cpu"
    if fused:
        # compiled (runtime/compiled.py): products and sums that inductor fuses with the block gather, reading
        # each cached key and value once, in the pool's layout; a matmul would first copy the gathered keys
        # transposed, element by element (1.3 ms a layer at batch 8 for SmolLM2, against 0.06 ms)
        scores = (q.reshape(B, KV, G * T, 1, D) * k[:, :, None]).sum(-1) * (D ** -0.5 if scale is None else scale)
    else:
        scores = (q.reshape(B, KV, G * T, D) @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(B, KV, G, T, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(B, KV, G * T, -1)
    if fused:
        return (probs[..., None] * v[:, :, None]).sum(-2).view(B, H, T, D)
    return (probs @ v).view(B, H, T, D)


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask,
                scale: float | None = None) -> torch.Tensor:
    """FlexAttention over mask.block; q [B, H, T, D] is padded to the block mask's t queries, and a mask of
    group G takes the G query heads of each KV head as G * t queries of one head (_flex_mask). On a
    failure (a kernel this torch/GPU cannot compile) warn once and go dense from then on."""
    (B, H, T, D), KV, t = q.shape, k.shape[1], mask.tree.shape[-1]
    if H != KV * mask.group and mask.group != 1:
        raise ValueError(f"a flex mask folding {mask.group} query heads per KV head got {H} query heads over {KV} "
                         "KV heads: build the step mask with this model's group (num_heads // num_kv_heads)")
    if t != T:
        q = F.pad(q, (0, 0, 0, t - T))
    if mask.group != 1:
        q = q.reshape(B, KV, mask.group * t, D)  # head h = kv * G + g -> queries g * t .. g * t + t - 1 of kv
    if k.shape[0] != B:  # the paged pool: one batch row for all, as a stride-0 view (no copy)
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    try:
        _mark_shapes(q, k, v, mask)
        out = _compiled_flex()(q, k, v, block_mask=mask.block, enable_gqa=q.shape[1] != KV, scale=scale)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any compile/runtime failure: the dense path is exact
        kernel_failed(_flex_error, exc, "FlexAttention", "attention falls back to dense masks, which read every cache "
                      "position")
        q = q.reshape(B, H, t, D)[:, :, :T]
        if mask.table is not None:  # k, v are the whole paged pool as one sequence: its blocks, as the pool holds them
            k_pool, v_pool = (x[0].transpose(0, 1).reshape(-1, BLOCK, *x.shape[1::2]) for x in (k, v))
            return attend_paged_dense(q, k_pool, v_pool, mask, scale)
        return attend_dense(q, k, v, dense_step_mask(mask.start, T, mask.kv_len, mask.tree), scale)
    return out.reshape(B, H, t, D)[:, :, :T]


def _mark_shapes(q, k, v, mask: AttnMask) -> None:
    """Batch dynamic, query count static: one compile serves every batch bucket, one per t bucket.
    Batch 1 stays static (torch.compile specialises sizes of 1 anyway). Inside a compiled layer
    (runtime/compiled.py) flex is traced into the layer's graph, whose own shapes rule: marking there is
    an error. `maybe_`: where torch specialises the batch anyway (flex compares q's batch with the paged
    pool's expanded one, a constant, in torch 2.11), it compiles per batch instead of failing."""
    if torch.compiler.is_compiling():
        return
    from torch._dynamo import mark_static, maybe_mark_dynamic

    bm = mask.block
    kv = [k, v] if k.stride(0) else []  # the paged pool's stride-0 batch stays as it is
    batched = [q, *kv, mask.start, mask.tree, mask.table, *mask.captured, bm.kv_num_blocks, bm.kv_indices,
               bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks,
               bm.full_q_indices]
    # torch 2.13's C++ (CPU) flex template fails to compile the paged mask with a dynamic batch; CPU runs
    # flex only in tests (the engine attends densely there), so it compiles per batch size instead
    if q.shape[0] > 1 and not (mask.table is not None and q.device.type == "cpu"):
        for x in batched:
            if x is not None:  # the q-side tables exist for the backward; torch may leave them out
                maybe_mark_dynamic(x, 0)
    mark_static(q, 2)
    mark_static(mask.tree, 1)
    mark_static(mask.tree, 2)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention compiled once per process; uncompiled it would materialise the scores."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    return torch.compile(flex_attention)
