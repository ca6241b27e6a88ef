"""Lossless verification of drafted chains and trees: pure, batched functions, no host sync inside.

Notation (docs/verification.md#chains, #trees): p_i is the target's processed distribution at draft position i,
q_i the drafter's (processed identically; one-hot for deterministic drafters such as n-gram or
suffix lookups), x_i the drafted token. For each sequence:

  accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
  on a rejection at i emit a token from the residual norm(max(0, p_i - q_i));
  if all k drafts are accepted emit a bonus token from p_k.

The emitted sequence then has exactly the law of sampling from p autoregressively (Leviathan et al.,
Chen et al. 2023). For a one-hot q the residual is p with x_i removed and renormalised: the law of a draw y_i ~ p_i
given y_i != x_i, so deterministic drafts are verified by drawing y_i at every position at once and accepting while
y_i == x_i, the next token y at the first position not accepted (docs/verification.md#deterministic-drafts).
Greedy (temperature 0): accept while x_i == argmax p_i, then emit argmax p at the first mismatch.

Rows are ragged: sequence b drafted num_drafts[b] <= K tokens; positions beyond are padding and
never accepted. Every sequence advances by its own accepted count.

Trees whose children are drafted deterministically (n-gram and suffix tries; any tree at temperature 0) take one
token x_j per node, argmax p_j or a draw from p_j, and descend from the root into the first child whose token is its
parent's x, as far as one matches; the next token is x at the node where the walk stops (`_match_walk`). Every node
is drawn at once, so the walk is a few small ops a depth. It is the law of asking the children in turn ("is it
c_1? c_2? ..."), docs/verification.md#deterministic-children.

Trees of sampled children use recursive rejection sampling at each node (`_recursive_reject`): the children are
tried in order against a running target p_i, child j with q_j, the distribution it was drawn from given the siblings
drawn before it. That one rule covers i.i.d. children (q_j = q: SpecInfer), children drawn without replacement
(q_j = q with x_1..x_{j-1} removed, renormalised: Recursive Speculative Decoding) and one-hot children (q_j =
one-hot x_j), so the draft's q says how its children were drawn and verification needs no flag.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.rollout.runtime.draws import ACCEPT, FINAL, NODE, TREE, KeyedDraws
from rlspec.rollout.runtime.sampling import (Draws, inverse_cdf, kernel_draws,
                                             probs_from_logits, sample, sample_plain, shifted, torch_sample_rows,
                                             truncates, uniform)
from rlspec.rollout.types import SamplingParams


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B] long: drafts accepted per sequence (0..num_drafts[b])
    next_token: torch.Tensor  # [B] long: the token emitted after the accepted drafts
    exact: torch.Tensor | None = None  # [B, K] bool: the exact test's verdict at each draft position
    # where the draw wrote it (a CPU kernel: sampling.sample_plain, _chain_op): the step's host transfer [B, C]
    # float64 as rollout/step_layout.py lays it out (the emitted tokens, their log p under the logits given and each
    # row's finite column; a chain's accepted count first); None otherwise: the engine packs it
    row: torch.Tensor | None = None


def verify_chain(
    target_logits: torch.Tensor,  # [B, K+1, V] float32: target logits at the pending token and each draft
    draft_tokens: torch.Tensor,  # [B, K] long
    num_drafts: torch.Tensor,  # [B] long, each <= K
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,  # [B, K, V] processed drafter probs; None = deterministic
    generator: Draws = None,  # or a call's per-sample keys bound to the rows (rollout/runtime/draws.py)
    kept: torch.Tensor | None = None,  # [B, K] bool: accepted whatever the exact test says; None = lossless
    p: torch.Tensor | None = None,  # [B, K+1, V]: probs_from_logits(target_logits, params), if the caller has it
) -> Verdict:
    """The chain rule of the module docstring. `kept` is where a lossy mode plugs in its own acceptance
    test (rollout/lossy/judge.py): a position it keeps counts as accepted, with the same draws in the same
    order, so with kept all False the result is the lossless one draw for draw."""
    B, K = draft_tokens.shape
    _check_q(draft_probs, (B, K), target_logits.shape[-1], "verify_chain")
    if K == 0 and not params.greedy:  # plain decoding: nothing to verify, the next token is drawn from p
        dev = target_logits.device
        none, zero = torch.zeros(B, 0, dtype=torch.bool, device=dev), torch.zeros(B, dtype=torch.long, device=dev)
        drawn = sample_plain(target_logits[:, 0], params, generator) if p is None else None
        if drawn is not None:
            return Verdict(zero, drawn[0], none, drawn[1])
        p = probs_from_logits(target_logits, params) if p is None else p
        return Verdict(zero, sample(p[:, 0], generator), none)  # the same draws as below
    drawn = _chain_op(target_logits, draft_tokens, num_drafts, params, draft_probs, generator) \
        if kept is None and p is None else None
    if drawn is not None:
        return drawn
    in_range = torch.arange(K, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    if params.greedy:
        target_top = target_logits.argmax(-1)  # [B, K+1]
        exact = target_top[:, :K] == draft_tokens
        accepted = _accepted(exact, kept, in_range)
        return Verdict(accepted, target_top.gather(1, accepted[:, None]).squeeze(1), exact)

    p = probs_from_logits(target_logits, params) if p is None else p  # [B, K+1, V]
    if draft_probs is None:  # deterministic drafts: the match walk of a one-branch tree (_match_walk)
        # y_i ~ p_i at every position at once; draft i is accepted while y_i == x_i, and the next token is y at the
        # first position not accepted: given y_a != x_a it has the one-hot residual's law, and at a full draft p_n's
        y = inverse_cdf(p, uniform(generator, (B, K + 1, 1), p.device, NODE)).squeeze(-1)  # [B, K+1]
        exact = y[:, :K] == draft_tokens
        accepted = _accepted(exact, kept, in_range)
        return Verdict(accepted, y.gather(1, accepted[:, None]).squeeze(1), exact)
    u = uniform(generator, (B, K), p.device, ACCEPT)
    exact = _accept(u, p[:, :K], draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1), draft_tokens)
    accepted = _accepted(exact, kept, in_range)  # [B]

    # Distribution of the next token: residual at the first rejection, or p itself for the bonus.
    p_next = p.gather(1, accepted[:, None, None].expand(B, 1, p.shape[-1])).squeeze(1)  # [B, V]: p at `accepted`
    rejected = accepted < num_drafts
    at = accepted.clamp(max=max(K - 1, 0))
    residual = _residual(p_next, draft_probs[torch.arange(B, device=p.device), at])  # q at the rejection
    dist = torch.where(rejected[:, None], residual, p_next)
    return Verdict(accepted, sample(dist, generator), exact)


def draw_plain(logits: torch.Tensor, params: SamplingParams, generator: Draws = None):
    """A step without drafts: the next token from logits [B, V] -> (token [B], row [B, 3] float64 or None), the same
    draws as verify_chain with K = 0. The row is the step's host transfer, [token, logprob, finite column]
    (rollout/step_layout.py), where the draw gives the logprob.

    Untruncated (no top-k, top-p or min-p) the distribution drawn from is softmax(logits / T), the one logprobs_of
    reads: the token's logprob is the log of its probability and the finite column the row's float64 sum, so a
    plain step needs no second pass over the vocabulary (a log-softmax) after the draw. A caller with a repetition
    penalty passes penalised logits and reads the logprob of the raw ones itself."""
    if params.greedy:
        return logits.argmax(-1), None
    if truncates(params, logits.shape[-1]):
        return sample(probs_from_logits(logits, params), generator), None
    drawn = sample_plain(logits, params, generator)
    if drawn is not None:
        return drawn
    return torch_sample_rows(logits, uniform(generator, (logits.shape[0],), logits.device, FINAL),
                             params.temperature)


def _chain_op(target_logits, draft_tokens, num_drafts, params, draft_probs, generator) -> Verdict | None:
    """verify_chain's rule as one CPU op (kernels/verify_chain.cpp), with the step's host transfer (the emitted
    tokens, their logprobs and finite flags); None where it does not serve (sampling.kernel_draws). The same
    uniforms in the same order as below: u [B, K] for the acceptance tests, then one per row for the next token. No
    `exact` (the lossless path reads none). Why: ~40 small ops over [B, K+1, V] and the host transfer's log-softmax
    were ~1.2 ms of a ~12 ms batch-1 CPU step with one draft (docs/verification.md#chains-on-the-cpu)."""
    if not kernel_draws(target_logits, params):
        return None
    B, K = draft_tokens.shape
    u = uniform(generator, (B, K), "cpu", ACCEPT)
    r = uniform(generator, (B,), "cpu", FINAL)
    q = _NO_Q if draft_probs is None else draft_probs.float()  # a no-op for float32 q
    accepted, token, row = torch.ops.rlspec_kernels.verify_chain_rows(
        target_logits, draft_tokens, num_drafts, q, u, r, float(params.temperature))
    return Verdict(accepted, token, None, row)


_NO_Q = torch.empty(0)  # _chain_op's q of deterministic drafts (one tensor: no op a step to make it)


def _accepted(exact: torch.Tensor, kept: torch.Tensor | None, in_range: torch.Tensor) -> torch.Tensor:
    """[B] drafts accepted: the run of accepted positions from the first (exact, or kept by a lossy test)."""
    ok = (exact if kept is None else exact | kept) & in_range
    return ok.long().cumprod(-1).sum(-1)


def _accept(u: torch.Tensor, p: torch.Tensor, q_x: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Accept x with probability min(1, p(x) / q(x)): u < p/q  <=>  u * q < p (no division by zero).

    u, q_x, x: [...]; p: [..., V] the target's processed distribution where x was drafted.
    """
    return u * q_x < p.gather(-1, x[..., None]).squeeze(-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. Its mass is 0 only where p == q on the support, where a
    rejection has probability 0; p stands in so the expression stays defined."""
    return _renormalised((p - q).clamp(min=0), p)


def _renormalised(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """r over its mass, or p where r has none."""
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


@dataclass
class TreeVerdict:
    path: torch.Tensor  # [B, N] long: accepted node indices (1..N) by depth, -1 after the last
    accepted: torch.Tensor  # [B] long
    next_token: torch.Tensor  # [B] long


def verify_tree(
    target_logits: torch.Tensor,  # [B, N+1, V]: node 0 is the pending token, node j+1 is draft j
    node_tokens: torch.Tensor,  # [B, N+1] long (node 0's entry unused)
    children: torch.Tensor,  # [B, N+1, W] long: child node indices of each node in drawing order, -1 = none
    params: SamplingParams,
    draft_probs: torch.Tensor | None = None,  # [B, N+1, V]: q_j of each node (node 0 unused); None = deterministic
    generator: Draws = None,
    depth: int | None = None,  # the deepest node of any row, as the host knows it (None: N, the most it can be)
) -> TreeVerdict:
    """Walk the tree from the root. Deterministic children (draft_probs None) or greedy verification: `_match_walk`
    against one token per node (argmax p, or a draw from p). Sampled children: at each node try its children with
    `_recursive_reject`.

    draft_probs[b, j] is the distribution node j's token was drawn from given the siblings listed
    before it (children[b, parent] lists siblings in that order). An accepted child moves the walk there, where the
    running distribution restarts at the target's p; where every child is rejected (or at a leaf) the next
    token is drawn from the last running distribution.
    The loops run a fixed number of times (no data-dependent exit, so no host sync). Past `depth` no row has a child
    to try: the match walk stops there, and recursive rejection's rounds only draw their uniforms from a shared
    generator, as a full round would (the tokens stay the same bit for bit), one op instead of ~50.
    """
    B, N1, W = children.shape
    _check_q(draft_probs, (B, N1), target_logits.shape[-1], "verify_tree")
    reach = N1 - 1 if depth is None else min(depth, N1 - 1)
    if params.greedy:
        return _match_walk(target_logits.argmax(-1), node_tokens, children, reach)
    p = probs_from_logits(target_logits, params)  # [B, N+1, V]
    if draft_probs is None:  # one draw per node, all at once
        x = inverse_cdf(p, uniform(generator, (B, N1, 1), p.device, NODE)).squeeze(-1)
        return _match_walk(x, node_tokens, children, reach)
    rows = torch.arange(B, device=node_tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=rows.device)
    alive = torch.ones(B, dtype=torch.bool, device=rows.device)
    path = torch.full((B, N1 - 1), -1, dtype=torch.long, device=rows.device)
    accepted = torch.zeros(B, dtype=torch.long, device=rows.device)
    final = p[:, 0]  # [B, V]: where a row's next token comes from once it stops
    for level in range(N1 - 1):
        if level >= reach:  # nothing left to try: the round's draws only, where they advance a generator
            if not isinstance(generator, KeyedDraws):
                uniform(generator, (B, W), p.device, TREE)
            continue
        kids = children[rows, cur]  # [B, W]
        valid = alive[:, None] & (kids >= 0)
        xs = node_tokens.gather(1, kids.clamp(min=0))  # [B, W]
        qs = draft_probs[rows[:, None], kids.clamp(min=0)]  # [B, W, V]
        # keyed draws: depth d's children take indices d*W .. d*W+W-1 (every row at every depth: no subsets)
        slot, rest = _recursive_reject(p[rows, cur], xs, qs, valid, shifted(generator, level * W))
        final = torch.where((alive & (slot < 0))[:, None], rest, final)
        moved = slot >= 0
        cur = torch.where(moved, kids.gather(1, slot.clamp(min=0)[:, None]).squeeze(1), cur)
        path[:, level] = torch.where(moved, cur, path[:, level])
        alive &= moved
        accepted += moved.long()
    final = torch.where(alive[:, None], p[rows, cur], final)  # rows that walked to a leaf at depth N
    return TreeVerdict(path, accepted, sample(final, generator))


def _match_walk(x: torch.Tensor, node_tokens: torch.Tensor, children: torch.Tensor, reach: int) -> TreeVerdict:
    """Deterministic children against x [B, N+1], the token each node's p gives (argmax, or a draw): from the root,
    move into the first child whose token is its parent's x while one is, at most `reach` times; the next token is x
    at the node reached. Exact for sampled x: at a node with children c_1..c_m the walk moves to c_j with
    probability p(c_j) and otherwise emits y with p(y), what recursive rejection of one-hot children gives
    (docs/verification.md#deterministic-children); each node's draw is used only if the walk gets there, so the
    draws along a path are independent. Greedy: the argmax walk, as the chain's. Every node's next step is
    worked out at once ([B, N+1]); the walk then reads one entry a depth."""
    B, N1, W = children.shape
    kids = children.clamp(min=0)
    match = (node_tokens.gather(1, kids.view(B, N1 * W)).view(B, N1, W) == x[..., None]) & (children >= 0)
    step = torch.where(match.any(-1), kids.gather(2, match.long().argmax(-1, keepdim=True)).squeeze(-1), -1)
    cur = torch.zeros(B, dtype=torch.long, device=x.device)
    path = torch.full((B, N1 - 1), -1, dtype=torch.long, device=x.device)
    moves = []
    for _ in range(reach):  # a row that stopped stays: its node's step is -1 again
        nxt = step.gather(1, cur[:, None]).squeeze(1)
        cur = torch.where(nxt >= 0, nxt, cur)
        moves.append(nxt)
    if moves:
        path[:, :reach] = torch.stack(moves, 1)
    return TreeVerdict(path, (path >= 0).sum(-1), x.gather(1, cur[:, None]).squeeze(1))


def _recursive_reject(
    p: torch.Tensor,  # [B, V] the target's processed distribution at the parent node
    xs: torch.Tensor,  # [B, W] long: the children's tokens, in drawing order
    qs: torch.Tensor,  # [B, W, V]: q_j each child was drawn from
    valid: torch.Tensor,  # [B, W] bool: which children exist
    generator: Draws,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over one node's children -> (slot [B] long: the accepted child's
    index in xs or -1, running [B, V]: the distribution to sample from where every child was rejected).

    Child j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); on a rejection
    p_{j+1} = norm(max(0, p_j - q_j)). Exact whenever x_j ~ q_j given the earlier children: by
    induction on the children left, the token that comes out (accepted child or final draw) has
    law p_j given the history, the standard one-draft argument at each step. A child whose q_j gives
    it no mass (a without-replacement draw past the end of q's support) cannot have been drawn from
    q_j: it is skipped and changes nothing.
    """
    B, W = xs.shape
    running = p
    slot = torch.full((B,), -1, dtype=torch.long, device=p.device)
    u = uniform(generator, (B, W), p.device, TREE)
    for j in range(W):
        x, q = xs[:, j], qs[:, j]
        q_x = q.gather(-1, x[:, None]).squeeze(-1)
        tried = valid[:, j] & (slot < 0) & (q_x > 0)
        ok = tried & _accept(u[:, j], running, q_x, x)
        slot = torch.where(ok, j, slot)
        running = torch.where((tried & ~ok)[:, None], _residual(running, q), running)
    return slot, running


def _check_q(q: torch.Tensor | None, lead: tuple[int, int], vocab: int, where: str) -> None:
    """Shapes only (no host sync): q must be [*lead, V] with the target's vocabulary V."""
    if q is not None and (q.dim() != 3 or tuple(q.shape[:2]) != lead or q.shape[-1] != vocab):
        raise ValueError(f"{where}: draft_probs has shape {tuple(q.shape)}, expected {(*lead, vocab)} "
                         "(one processed drafter distribution over the target's vocabulary per draft node)")
