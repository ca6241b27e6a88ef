"""Logit processing shared by the target and every drafter, so both see the same distribution.

Speculative sampling is lossless only if p (target) is processed exactly as the call asks, and
acceptance stays high only if q (drafter) is processed the same way: repetition penalty, temperature,
top-k, top-p, min-p (docs/verification.md#processing). This is the one place it happens.
"""
from __future__ import annotations

import torch

from rlspec.rollout.runtime.draws import FINAL, KeyedDraws
from rlspec.rollout.runtime.model import kernels
from rlspec.rollout.runtime.model.attention import triton_available, with_fallback
from rlspec.rollout.types import SamplingParams

# a draw site's source of uniforms: the call's torch.Generator (None: torch's global one), or a call's per-sample
# keys bound to the rows drawn (rollout/runtime/draws.py)
Draws = torch.Generator | KeyedDraws | None


def uniform(gen: Draws, shape: tuple[int, ...], device, purpose: int) -> torch.Tensor:
    """float32 uniforms [*shape] in [0, 1) for a draw site: torch.rand from the generator, as every site always
    drew them (purpose unused), or the keyed hash of each row's (key, position, purpose, index)."""
    if isinstance(gen, KeyedDraws):
        return gen.uniform(tuple(shape), purpose)
    return torch.rand(shape, generator=gen, device=device)


def shifted(gen: Draws, by: int) -> Draws:
    """The same source with a keyed source's indices moved on by `by` (a tree's later depths); a generator as is."""
    return gen.shifted(by) if isinstance(gen, KeyedDraws) else gen


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p(token) under the temperature-scaled distribution of the raw logits, before the repetition
    penalty and top-k/top-p/min-p (what TRL recomputes; docs/verification.md#logprobs).

    logits [..., V] float32, tokens [...] long -> [...] float32. Greedy uses temperature 1.
    """
    scaled = logits if params.greedy or params.temperature == 1.0 else logits / params.temperature  # x / 1 == x
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def penalise(logits: torch.Tensor, seen: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: a logit of a token in the history (`seen`
    [..., V] bool, broadcast against logits [..., V]) is divided by the penalty when positive and
    multiplied by it otherwise. Raw logits in, before temperature: generate applies it as a processor,
    ahead of every warper, and at temperature 0 too. seen None or penalty 1 -> logits unchanged."""
    if seen is None or not params.penalised:
        return logits
    pen = params.repetition_penalty
    return torch.where(seen, torch.where(logits < 0, logits * pen, logits / pen), logits)


def greedy_tokens(logits: torch.Tensor, seen: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """Temperature 0: the argmax of the penalised logits (the warpers never drop the top token)."""
    return penalise(logits, seen, params).argmax(-1)


def truncates(params: SamplingParams, vocab: int) -> bool:
    """Whether probs_from_logits cuts the distribution after the temperature (top-k, top-p or min-p on). Where it
    does not, its law is softmax(logits / T) of the penalised logits: what sample_plain's op draws from."""
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution: the repetition penalty over `seen` (the history each row's token follows;
    None = no penalty), then logits / T truncated by top-k, top-p, then min-p.

    logits [..., V] float32 -> probs [..., V] float32 (rows sum to 1). The same operations, in the
    same order, as transformers' generate: RepetitionPenaltyLogitsProcessor, then
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper (with
    min_tokens_to_keep=1), so that which tokens survive a tie or a boundary is decided exactly as
    there; tests/rollout/runtime/test_sampling_parity.py holds them together. (vLLM applies min-p
    before top-k/top-p: with top-p also on, its law differs from this one.)
    """
    scores = penalise(logits, seen, params)
    if params.temperature != 1.0:  # x / 1 == x: at T = 1 (RL's usual setting) skip a pass over [rows, V]
        scores = scores / params.temperature
    if not truncates(params, scores.shape[-1]):  # sample_plain and draw_plain draw from exactly this (keep in step)
        return torch.softmax(scores, dim=-1)
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th token stay
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    if params.min_p > 0:
        scores = _min_p(scores, params.min_p)
    return torch.softmax(scores, dim=-1)


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability (softmax of the truncated scores, as HF computes it) is below
    min_p times the top token's. The top token always stays (its probability is the maximum and
    min_p <= 1), which is HF's min_tokens_to_keep=1."""
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop the least likely tokens while their cumulative mass stays <= 1 - top_p; the most likely
    token always stays. scores [..., V] -> scores [..., V] with dropped tokens at -inf.

    HF's rule, ascending sort included: a descending cumsum ("mass before >= top_p") is the same in
    exact arithmetic but rounds differently at the boundary and keeps a different one of tied tokens.
    """
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def sample(probs: torch.Tensor, generator: Draws) -> torch.Tensor:
    """One token per row of probs [B, V] -> [B] long, by inverting the CDF at a uniform draw.

    Exact like torch.multinomial (a zero-probability token can never be hit: u is drawn in
    (0, total]) and on CPU over 20x faster for a 49k vocabulary, where multinomial was the largest
    cost of a batch-8 decode step (7 ms against 0.3 ms).
    """
    return drawn_column(probs, generator).squeeze(-1)


def drawn_column(probs: torch.Tensor, generator: Draws) -> torch.Tensor:
    """sample()'s tokens as a column [..., 1], the index a gather of their probabilities takes as it is."""
    return inverse_cdf(probs, uniform(generator, probs.shape[:-1] + (1,), probs.device, FINAL))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """drawn_column's tokens [..., 1] for its uniforms u [..., 1] in [0, 1), drawn beforehand (a graph reads them
    from a buffer: drafters/eagle3_graphs.py)."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (1 - u) * cdf[..., -1:]).clamp_(max=probs.shape[-1] - 1)


def kernel_draws(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether the CPU kernels draw this step (kernels/sample.cpp, verify_chain.cpp): sampling with no top-k, top-p
    or min-p (a repetition penalty is the caller's: it passes the penalised logits), float32 logits on the CPU, the
    kernels built (kernels.draws_available). Their law is probs_from_logits' there; their bits are not (their softmax
    is their own)."""
    return not (params.greedy or truncates(params, logits.shape[-1]) or logits.device.type != "cpu"
                or logits.dtype != torch.float32) and kernels.draws_available()


def sample_plain(logits: torch.Tensor, params: SamplingParams, generator: Draws):
    """A plain step's draw from probs_from_logits(logits, params), with its logprob (logprobs_of) and each row's
    finite column, as one op on a CPU (kernels/sample.cpp) and two Triton kernels on CUDA (model/sample_rows.py, the
    same contract) -> (tokens [B], row [B, 3] float64: the step's host transfer, [token, logprob, finite column] as
    rollout/step_layout.py lays it out); None where neither serves (`kernel_draws`, `device_draws`; with a
    repetition penalty the caller reads the logprob elsewhere). The same uniforms from the generator as sample().

    logits [B, V] float32. Why: torch's five passes over each row's vocabulary and ~35 small ops were ~0.75 ms of a
    batch-1 CPU step (docs/verification.md#plain-steps-on-the-cpu); on a GPU ~9 kernels and five passes over [B, V]
    float32 (docs/gpu.md#the-draw)."""
    on_cpu = kernel_draws(logits, params)
    if not (on_cpu or device_draws(logits, params)):
        return None
    r = uniform(generator, (logits.shape[0],), logits.device, FINAL)  # the op draws at 1 - r, in (0, 1], as sample()
    if on_cpu:
        return torch.ops.rlspec_kernels.sample_rows(logits, r, float(params.temperature))
    return _device_sample_rows(logits, r, float(params.temperature))


def device_draws(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether our Triton kernels draw this step (model/sample_rows.py): sampling with no top-k, top-p or min-p,
    float32 logits on CUDA, outside compiled code, with Triton installed and the kernels not failed in this process.
    Their law is probs_from_logits' there."""
    return not (params.greedy or truncates(params, logits.shape[-1]) or not logits.is_cuda
                or logits.dtype != torch.float32 or torch.compiler.is_compiling() or _draw_error) and triton_available()


def torch_sample_rows(logits: torch.Tensor, r: torch.Tensor, temperature: float):
    """sample_plain's draw in torch's ops, where no kernel serves (and the Triton kernels' fallback): softmax(logits /
    T), its CDF inverted at 1 - r (`inverse_cdf`), the token's log-probability and the row's float64 sum for its
    finite column (NaN or inf where a logit is) -> (token [B], row [B, 3] float64)."""
    probs = torch.softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    column = inverse_cdf(probs, r[:, None])
    finite = logits.sum(-1, keepdim=True, dtype=torch.float64)
    return column.squeeze(1), torch.cat([column, probs.gather(1, column).log_(), finite], 1)


def _triton_sample_rows(*args):
    from rlspec.rollout.runtime.model.sample_rows import sample_rows  # imports triton: on first use

    return sample_rows(*args)


_draw_error: list[str] = []  # the Triton draw's first failure in this process
_device_sample_rows = with_fallback(_triton_sample_rows, torch_sample_rows, _draw_error, "the Triton draw kernels",
                                    "plain steps draw with torch's ops from now on")


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None,
                               u: torch.Tensor | None = None):
    """k distinct tokens per row of probs [R, V], one after another: x_1 ~ probs, then x_j ~ probs
    with x_1..x_{j-1} removed and renormalised (what Recursive Speculative Decoding drafts).

    Returns (tokens [R, k] long, dists [R, k, V]: the distribution each x_j was drawn from, which
    verification needs as that child's q). When a row's support runs out before k draws, its later
    dists are all zero and their tokens arbitrary: verification never accepts a token its q gives no
    mass, so such children are inert. u [R, k]: the draws' uniforms, taken beforehand (a graph reads them from a
    buffer); None: one sample() call a draw.
    """
    tokens, dists = [], []
    q = probs
    for j in range(k):
        x = sample(q, generator) if u is None else inverse_cdf(q, u[:, j:j + 1])[:, 0]
        tokens.append(x)
        dists.append(q)
        q = q.scatter(-1, x[..., None], 0.0)
        mass = q.sum(-1, keepdim=True)
        q = torch.where(mass > 0, q / mass.clamp(min=1e-30), torch.zeros_like(q))
    return torch.stack(tokens, -1), torch.stack(dists, -2)
