"""Paged decode attention in Triton: a step's queries over each row's cached keys and values, read in place
from the layer's pool through the rows' block tables, split along the context (flash-decoding).

What it computes is attention.attend_dense over the step mask (attention.dense_step_mask): every query sees its
row's `start` cached positions and, among the step's own T new keys (already written to the pool at positions
start .. start + T - 1), what the tree allows (None: a chain, node i sees nodes 0..i).

Why a kernel of our own (docs/gpu.md#paged-decode-attention): FlexAttention gives a decode step one program per
(row, KV head, query block) that walks the whole context, so a batch of one at 8k positions ran 4 programs on a
132-SM GPU, 3.7 ms for 0.46 GB of KV. Here each (row, KV head) splits its live context into NS chunks, NS chosen
so that the grid fills the GPU; a second kernel merges the chunks' partial softmaxes by their log-sum-exps. One
program holds all G query heads that share a KV head (and the T tokens of a verify), so each KV position is read
once per step. The chunk length follows each row's live length (start + T) inside the kernel, so the grid is
fixed by the batch and the cache size alone and one CUDA graph serves every context.

The same kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET, numpy): slow, for the tests
(tests/rollout/runtime/test_paged_decode.py) on machines without a GPU. The engine never picks them on a CPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlspec.rollout.runtime.model import pdl
from rlspec.rollout.runtime.model.pdl import dependent_start

MAX_TILE_KEYS = 64  # keys per loop iteration at most (`tile_keys`)
TILE_BYTES = 16 * 1024  # a tile of keys at most (and one of values): double buffered, 64 KB of shared memory
TILE_SCORES = 2048  # queries x keys of a tile at most: a tree verify's 64 queries take 32 keys (registers)
MAX_ROWS = 64  # queries (G heads x T tokens) per program at most: the accumulator is MAX_ROWS x head dim
MAX_SPLITS = 64
STAGES = 3  # Triton's software pipeline: tile i + 1's keys and values load while tile i's are computed on
PER_SM = 2  # programs a launch wants per SM (`splits`): each holds 64 KB of shared memory, three fit on sm_90


@triton.jit
def _split(Q, K, V, Table, Start, Tree, Out, Lse,
           sq_b, sq_h, sq_t, sk_blk, sk_pos, sk_h, sv_blk, sv_pos, sv_h, st_b, str_b, str_q,
           so_b, so_s, so_t, so_h, sl_b, sl_s, sl_t, scale,
           T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
           N: tl.constexpr, M: tl.constexpr, QT: tl.constexpr, NS, TREE: tl.constexpr, DIRECT: tl.constexpr,
           F32: tl.constexpr, PDL: tl.constexpr):
    """One (row b, KV head x query tile, split s): the partial attention of up to M queries over the split's
    chunk of the row's live keys -> Out (normalised within the chunk, float32) and Lse (its log-sum-exp); with
    DIRECT (NS == 1) the final output in Out's dtype and no Lse. NS is a runtime argument: one compile serves
    every batch size (each picks its own NS); the constants are the shapes of a step's queries. F32: the products
    take float32 operands at full precision (a float32 model, and 16-bit ones in Triton's interpreter, which
    multiplies 16-bit operands wrongly; their products are exact in float32). PDL: launched dependent on the kernel
    before (pdl.py)."""
    dependent_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // QT
    r = (tl.program_id(1) % QT) * M + tl.arange(0, M)  # query r: head kvh * G + r // T, token r % T
    row_ok = r < G * T
    h = kvh * G + r // T
    qt = r % T
    d = tl.arange(0, DP)
    d_ok = d < D
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + qt[:, None] * sq_t + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32:
        q = q.to(tl.float32)
    start = tl.load(Start + b).to(tl.int32)  # positions, and the loop over them, in 32 bits
    live = start + T
    chunk = tl.cdiv(tl.cdiv(live, NS), N) * N  # a whole number of tiles, so tiles stay inside pool blocks
    lo = tl.program_id(2) * chunk
    hi = tl.minimum(lo + chunk, live)
    # each tile's pool block is loaded one tile ahead and carried: a tile's keys then depend on no load of their own
    # iteration, which Triton's pipeliner needs to issue their copies a tile early (with the table read in the same
    # iteration it kept one buffer and waited for every copy before each tile). A chunk past `live` (hi <= lo) reads
    # its row's last block, never a column past the table.
    blk = tl.load(Table + b * st_b + tl.minimum(lo, hi - 1) // BS).to(tl.int64)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DP], tl.float32)
    for p0 in range(lo, hi, N):
        pos = p0 + tl.arange(0, N)
        pos_ok = pos < hi
        nxt = tl.load(Table + b * st_b + tl.minimum(p0 + N, hi - 1) // BS).to(tl.int64)
        at = pos % BS
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(K + blk * sk_blk + at[:, None] * sk_pos + kvh * sk_h + d[None, :], mask=kv_ok, other=0.0)
        if F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        rel = pos - start  # >= 0: one of the step's own keys
        if TREE:
            seen = tl.load(Tree + b * str_b + qt[:, None] * str_q + tl.maximum(rel, 0)[None, :],
                           mask=row_ok[:, None] & (pos_ok & (rel >= 0))[None, :], other=0) != 0
        else:
            seen = rel[None, :] <= qt[:, None]
        vis = pos_ok[None, :] & ((rel < 0)[None, :] | seen)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees nothing here yet
        alpha = tl.exp(m_i - base)
        p = tl.exp(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + blk * sv_blk + at[:, None] * sv_pos + kvh * sv_h + d[None, :], mask=kv_ok, other=0.0)
        p = p.to(v.dtype)  # the probabilities rounded to the values' dtype, as the dense reference does
        if F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
        blk = nxt
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    at_out = Out + b * so_b + tl.program_id(2) * so_s + qt[:, None] * so_t + h[:, None] * so_h + d[None, :]
    tl.store(at_out, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if not DIRECT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(Lse + b * sl_b + tl.program_id(2) * sl_s + qt * sl_t + h, lse, mask=row_ok)


@triton.jit
def _combine(Part, Lse, Out, sp_b, sp_s, sp_t, sp_h, sl_b, sl_s, sl_t, so_b, so_t, so_h,
             H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NS, NSP: tl.constexpr, PDL: tl.constexpr):
    """One (row b, token t x head h): the splits' partial outputs weighted by exp(their lse - the largest)."""
    dependent_start(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1) // H
    h = tl.program_id(1) % H
    s = tl.arange(0, NSP)
    d = tl.arange(0, DP)
    lse = tl.load(Lse + b * sl_b + s * sl_s + t * sl_t + h, mask=s < NS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    part = tl.load(Part + b * sp_b + s[:, None] * sp_s + t * sp_t + h * sp_h + d[None, :],
                   mask=(s < NS)[:, None] & (d < D)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * so_b + t * so_t + h * so_h + d, out.to(Out.dtype.element_ty), mask=d < D)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's SMs; on a CPU (the interpreter) 4."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_wanted(device: torch.device, per_sm: int) -> int:
    """Programs that fill the device: per_sm on each SM."""
    return per_sm * _multiprocessors(device)


def tile_keys(M: int, DP: int, itemsize: int, BS: int) -> int:
    """Keys per loop iteration for M queries a program of (padded) head size DP, keys of itemsize bytes, over a pool
    of BS-position blocks: MAX_TILE_KEYS for a decode step's 16 queries of head size 128 in 16 bits, fewer where a
    tile would pass TILE_BYTES (float32; Gemma's heads of 256) or TILE_SCORES (a tree verify's 64 queries), never
    more than a block, which a tile must divide (block sizes are powers of two from 16). Per program, the tiles in
    flight are what keeps the memory busy: on sm_90 a decode tile is 16 KB of keys and 16 of values, two of each
    buffered (tests/rollout/runtime/triton_aot.py prints each variant's buffers and shared memory)."""
    return max(16, min(MAX_TILE_KEYS, TILE_BYTES // (DP * itemsize), TILE_SCORES // M, BS))


def warps(M: int, DP: int) -> int:
    """Warps a program of M queries of (padded) head size DP runs on: 4 up to 16 x 128, else 8 (a tree verify's 64
    queries spilled registers from 4 warps on sm_90; 16 of Gemma's 256 took all 255: tests/rollout/runtime/
    triton_aot.py prints each variant's usage)."""
    return 4 if M * DP <= 2048 else 8


def splits(rows: int, programs: int, positions: int, device: torch.device, keys: int, per_sm: int = PER_SM) -> int:
    """Chunks per (row, KV head, query tile): enough programs to fill the device (per_sm an SM), at most one per
    tile of `keys` of the longest context the cache holds (`positions`) and MAX_SPLITS. Fixed by shapes alone (a
    CUDA graph's grid)."""
    want = -(-_programs_wanted(device, per_sm) // (rows * programs))
    return max(1, min(want, -(-positions // keys), MAX_SPLITS))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 start: torch.Tensor, tree: torch.Tensor | None, scale: float | None = None, keys: int | None = None,
                 stages: int = STAGES, per_sm: int = PER_SM) -> torch.Tensor:
    """Attention of a step's queries q [B, H, T, D] over each row's `start` cached positions and its T new keys,
    read from one layer's pools k_pool/v_pool [num_blocks, block_size, KV, D] through table [B, >= blocks]
    (long or int); tree [B, >= T, >= T] bool (None: a chain). Returns [B, H, T, D] in q's dtype, a transposed
    view of a [B, T, H, D] tensor (what the o_proj product reads without a copy). keys (None: `tile_keys`),
    stages and per_sm set the launch (the device check times others: rlspec/bench/gpucheck/contexts.py)."""
    B, H, T, D = q.shape
    NB, BS, KV, Dk = k_pool.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    # the kernel reads a row's start and its table entries side by side: a step's start may be a column of the
    # host's packed transfer (stride 2), which read as if contiguous gives every row but the first another's length
    start, table = start.contiguous(), table if table.stride(-1) == 1 else table.contiguous()
    DP = max(16, triton.next_power_of_2(D))
    G = H // KV if KV and H % KV == 0 else 1
    M = max(16, min(triton.next_power_of_2(G * T), MAX_ROWS))
    N = keys or tile_keys(M, DP, k_pool.element_size(), BS)
    if Dk != D or H % KV or BS % N or N % 16 or T < 1:
        raise ValueError(f"paged_decode: queries [B, H, T, D] = {list(q.shape)} over pools {list(k_pool.shape)}: "
                         f"needs the same head size, H a multiple of the KV heads and a block size that is a "
                         f"power of two from 16 (tiles of {N} keys)")
    QT = -(-G * T // M)
    NS = splits(B, KV * QT, table.shape[1] * BS, q.device, N, per_sm)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if NS == 1:
        part, lse = out.unsqueeze(1), out  # lse unused (DIRECT)
    else:
        part = torch.empty(B, NS, T, H, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, NS, T, H, dtype=torch.float32, device=q.device)
    if tree is not None and tree.stride(-1) != 1:
        tree = tree.contiguous()  # the kernel reads a tree row's entries side by side
    tree_u8 = tree.view(torch.uint8) if tree is not None else start  # a placeholder pointer without a tree
    tree_strides = tree_u8.stride()[:2] if tree is not None else (0, 0)
    launch = pdl.launch(pdl.serves(q))  # both kernels' PDL arguments
    _split[(B, KV * QT, NS)](
        q, k_pool, v_pool, table, start, tree_u8, part, lse,
        q.stride(0), q.stride(1), q.stride(2), *k_pool.stride()[:3], *v_pool.stride()[:3], table.stride(0),
        *tree_strides, *part.stride()[:4], *(lse.stride()[:3] if NS > 1 else (0, 0, 0)),
        D ** -0.5 if scale is None else scale,
        T=T, G=G, D=D, DP=DP, BS=BS, N=N, M=M, QT=QT, NS=NS, TREE=tree is not None, DIRECT=NS == 1,
        F32=q.dtype == torch.float32 or q.device.type != "cuda", num_warps=warps(M, DP), num_stages=stages,
        **launch)
    if NS > 1:
        _combine[(B, T * H)](part, lse, out, *part.stride()[:4], *lse.stride()[:3], *out.stride()[:3],
                            H=H, D=D, DP=DP, NS=NS, NSP=triton.next_power_of_2(NS), **launch)
    return out.transpose(1, 2)
