"""A plain step's draw from softmax(logits / T) on CUDA, with the drawn token's logprob and the row's finite column,
in two Triton kernels: what kernels/sample.cpp (the CPU op of the same name) does on a CPU, with the same contract.

    sample_rows(logits [B, V] float32, r [B] float32 in [0, 1), temperature) -> (token [B] long,
                row [B, 3] float64: token, logprob, finite column)

The token inverts the CDF of softmax(logits / T) at u = 1 - r, as sampling.sample does: the first token whose
cumulative (unnormalised) mass reaches u times the total, never a token of mass 0. logprob is log softmax(logits /
T) at that token (sampling.logprobs_of); the finite column is 0 where every logit of the row is finite and -inf where
not. The row is the plain step's host transfer as rollout/step_layout.py lays it out.

Why: torch's draw is a softmax, a cumulative sum, a search, a gather and log, and the float64 sum of the finite
check, ~9 kernels and five passes over [B, V] float32 (each pass 78 MB at batch 128 with Qwen's 152k vocabulary,
~0.1 ms of an H200 step; a tenth of a 0.5B model's step). Here a row's logits are read once and a part of them
again:
- `_chunk_stats`, program (row, chunk): over its chunk of the vocabulary, the maximum of x / T and the sum of
  exp(x / T - max) (one pass, the sum rescaled as the maximum grows) and whether a logit is NaN or inf. A row is
  split into as many chunks as fill the device (two programs an SM over the batch's rows), so a batch of one reads its
  row with every SM, where one program a row would read it with one;
- `_draw`, a program a row: the chunks' sums at the row's maximum, their running total, the chunk where it reaches
  u times the total, and the scan of that chunk alone, a block at a time, to the token. Where rounding leaves the
  scan short of the target (u near 1), the last token with mass in the chunk is drawn, as the exact inverse at u = 1.

The same kernels run on CPU tensors through Triton's interpreter (tests/rollout/runtime/test_sample_rows.py); the
engine calls them on CUDA only (sampling.sample_plain)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlspec.rollout.runtime.model import pdl
from rlspec.rollout.runtime.model.pdl import dependent_start

BLOCK = 2048  # logits a load (8 KB of float32)
PROGRAMS = 264  # _chunk_stats' programs aimed at where the device does not say: two for each of an H100's 132 SMs


@triton.jit
def _chunk_stats(X, Stats, V, s_x, CH, temperature, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, c): row b's logits [c CH, min((c + 1) CH, V)) -> Stats[b, c] = (max of x / T, sum of exp(x / T -
    max), count of NaN and inf logits)."""
    dependent_start(PDL)
    b, c = tl.program_id(0), tl.program_id(1)
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    m = -float("inf")
    z = 0.0
    bad = 0.0
    for v0 in range(lo, hi, BLOCK):
        i = v0 + tl.arange(0, BLOCK)
        ok = i < hi
        x = tl.load(X + b * s_x + i, mask=ok, other=0.0)
        bad += tl.sum(tl.where(ok & ((x != x) | (tl.abs(x) == float("inf"))), 1.0, 0.0))
        s = tl.where(ok, x / temperature, -float("inf"))
        grown = tl.maximum(m, tl.max(s, 0))
        z = z * tl.exp(m - grown) + tl.sum(tl.exp(s - grown), 0)
        m = grown
    at = (b * tl.num_programs(1) + c) * 3
    tl.store(Stats + at, m)
    tl.store(Stats + at + 1, z)
    tl.store(Stats + at + 2, bad)


@triton.jit
def _draw(X, Stats, R, Tok, Row, V, s_x, S, CH, temperature, SP: tl.constexpr, BLOCK: tl.constexpr,
          PDL: tl.constexpr):
    """Program b: row b's token at u = 1 - R[b] from its chunks' Stats[b, :S], its logprob and finite column."""
    dependent_start(PDL)
    b = tl.program_id(0)
    c = tl.arange(0, SP)
    live = c < S
    mc = tl.load(Stats + (b * S + c) * 3, mask=live, other=-float("inf"))
    zc = tl.load(Stats + (b * S + c) * 3 + 1, mask=live, other=0.0)
    bad = tl.sum(tl.load(Stats + (b * S + c) * 3 + 2, mask=live, other=0.0), 0)
    m = tl.max(mc, 0)
    mass = tl.where(live & (zc > 0), zc * tl.exp(mc - m), 0.0)  # each chunk's sum at the row's maximum
    total = tl.sum(mass, 0)
    target = (1.0 - tl.load(R + b)) * total
    reached = (mass > 0) & (tl.cumsum(mass, 0) >= target)
    chunk = tl.min(tl.where(reached, c, SP), 0)
    chunk = tl.where(chunk < SP, chunk, tl.max(tl.where(mass > 0, c, 0), 0))  # rounding short of it: the last
    running = tl.sum(tl.where(c < chunk, mass, 0.0), 0)
    lo = chunk * CH
    hi = tl.minimum(lo + CH, V)
    found = -1
    last = lo  # the chunk's last token with mass so far
    v0 = lo
    while (v0 < hi) & (found < 0):
        i = v0 + tl.arange(0, BLOCK)
        ok = i < hi
        e = tl.where(ok, tl.exp(tl.load(X + b * s_x + i, mask=ok, other=0.0) / temperature - m), 0.0)
        cum = running + tl.cumsum(e, 0)
        j = tl.min(tl.where((e > 0) & (cum >= target), i, V), 0)
        found = tl.where(j < V, j, -1)
        last = tl.maximum(last, tl.max(tl.where(e > 0, i, -1), 0))
        running = tl.max(tl.where(ok, cum, running), 0)  # the block's total (cum does not decrease)
        v0 += BLOCK
    token = tl.where(found >= 0, found, last)
    logprob = tl.load(X + b * s_x + token) / temperature - m - tl.log(total)
    tl.store(Tok + b, token.to(tl.int64))
    tl.store(Row + b * 3, token.to(tl.float64))
    tl.store(Row + b * 3 + 1, logprob.to(tl.float64))
    tl.store(Row + b * 3 + 2, tl.where(bad > 0, -float("inf"), 0.0).to(tl.float64))


def chunks(B: int, V: int, programs: int) -> tuple[int, int]:
    """(S, CH): each row's chunks and their length (whole blocks) so that B x S programs come near `programs`."""
    want = max(1, min(-(-programs // B), triton.cdiv(V, BLOCK)))
    CH = triton.cdiv(triton.cdiv(V, want), BLOCK) * BLOCK
    return triton.cdiv(V, CH), CH


def sample_rows(logits: torch.Tensor, r: torch.Tensor, temperature: float,
                programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/sample.cpp's op on CUDA (the module docstring): logits [B, V] float32, r [B] float32 in [0, 1) ->
    (token [B] long, row [B, 3] float64). programs: _chunk_stats' programs aimed at (default: two an SM)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or r.shape != logits.shape[:1]:
        raise ValueError(f"sample_rows takes float32 logits [B, V] and r [B]; got {logits.dtype} "
                         f"{tuple(logits.shape)} and {tuple(r.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    if programs is None:
        programs = 2 * torch.cuda.get_device_properties(logits.device).multi_processor_count \
            if logits.is_cuda else PROGRAMS
    S, CH = chunks(B, V, programs)
    stats = torch.empty(B, S, 3, dtype=torch.float32, device=logits.device)
    token = torch.empty(B, dtype=torch.long, device=logits.device)
    row = torch.empty(B, 3, dtype=torch.float64, device=logits.device)
    launch = pdl.launch(pdl.serves(logits))
    t = float(temperature)
    _chunk_stats[(B, S)](logits, stats, V, logits.stride(0), CH, t, BLOCK=BLOCK, num_warps=8, **launch)
    _draw[(B,)](logits, stats, r.float().contiguous(), token, row, V, logits.stride(0), S, CH, t,
                SP=max(16, triton.next_power_of_2(S)), BLOCK=BLOCK, num_warps=8, **launch)
    return token, row
