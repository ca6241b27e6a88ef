"""A Markov-chain target and drafter with an exactly known law: the harness of the verify-level tests.

Target: next-token logits P_LOGITS[prev] over V = 5 tokens; drafter: Q_LOGITS[prev], a different
chain. A window of L = 5 tokens after token 0 is sampled by repeated draft + verify steps with the
real verify functions (called through the module, so tests can swap in broken variants). Draft
lengths are ragged (0..K per row) and padding carries garbage tokens and q, which verification
must ignore; with K = 3 < L the token after a fully accepted draft (the bonus) lies in the window.
The exact law is the product of the target's transitions processed by transformers' own warpers,
not by rollout's processing, so the reference shares no code with what it checks.
"""
from __future__ import annotations

import torch

import rlspec.rollout.speculation.verify as verify
from tests.rollout.law_helpers import chi2_pvalue, hf_warpers

V, L, K, W = 5, 5, 3, 3
_gen = torch.Generator().manual_seed(123)
P_LOGITS = torch.randn(V, V, generator=_gen) * 1.5  # target: next-token logits given the previous token
Q_LOGITS = torch.randn(V, V, generator=_gen) * 1.5  # drafter: a different chain


def transitions(logits: torch.Tensor, params) -> torch.Tensor:
    """[V, V] logits -> [V, V] processed next-token distributions (HF warpers, then softmax)."""
    return torch.softmax(hf_warpers(params)(None, logits.clone()), -1)


def exact_law(params) -> torch.Tensor:
    """[V**L] float64: the target's law of the window, sequences in base-V order."""
    trans = transitions(P_LOGITS, params).double()
    law = trans[0]
    for _ in range(L - 1):  # a code's last token is code % V: extend each sequence by its transition row
        law = (law[:, None] * trans[torch.arange(len(law)) % V]).view(-1)
    return law


def _multi(probs: torch.Tensor, gen) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def chain_step(prev, params, gen, deterministic=False, q_params=None):
    """One draft + verify_chain per row from the previous token prev [B] -> (emitted [B, K+1], count [B]).

    Drafts are q's argmax path (deterministic, verified with one-hot q) or sampled from q; q_params
    samples them from a differently processed q than the verifier is told (a flaw)."""
    B = len(prev)
    told, drawn = transitions(Q_LOGITS, params), transitions(Q_LOGITS, q_params or params)
    num = torch.randint(0, K + 1, (B,), generator=gen)
    tokens, qs, cur = [], [], prev
    for _ in range(K):
        qs.append(told[cur])
        cur = drawn[cur].argmax(-1) if deterministic else _multi(drawn[cur], gen)
        tokens.append(cur)
    drafts, q = torch.stack(tokens, 1), torch.stack(qs, 1)
    pad = torch.arange(K)[None, :] >= num[:, None]
    drafts = torch.where(pad, torch.randint(0, V, (B, K), generator=gen), drafts)
    junk = torch.rand(B, K, V, generator=gen)
    q = torch.where(pad[..., None], junk / junk.sum(-1, keepdim=True), q)
    ctx = torch.cat([prev[:, None], drafts], 1)
    v = verify.verify_chain(P_LOGITS[ctx], drafts, num, params, None if deterministic else q, gen)
    emitted = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, v.accepted[:, None], v.next_token[:, None])
    return emitted, v.accepted + 1


def tree_step(prev, params, gen, mode, told="as_drawn"):
    """One draft tree + verify_tree per row -> (emitted [B, 3], count [B]).

    The root gets up to W = 3 children: "iid" draws from q, "wor" draws without replacement (each
    child's q has the earlier ones removed), "topk" q's top 3 (deterministic, one-hot rule). Each
    child may have one child of its own (sampled from q, or q's argmax for "topk"). Ragged: 2 or 3
    root children and each grandchild present with probability 1/2. told="shared" tells the
    verifier the unrestricted q for every root child (and for "topk", that they were sampled).
    """
    B = len(prev)
    tq = transitions(Q_LOGITS, params)
    q_root = tq[prev]
    if mode == "topk":
        kids = q_root.topk(W, -1).indices
        kid_q = q_root[:, None].expand(B, W, V)
    elif mode == "iid":
        kids = torch.multinomial(q_root, W, replacement=True, generator=gen)
        kid_q = q_root[:, None].expand(B, W, V)
    else:  # without replacement, sequentially; past the end of q's support the child's q is 0
        cur, picks, qs = q_root, [], []
        for _ in range(W):
            mass = cur.sum(-1, keepdim=True)
            x = _multi(torch.where(mass > 0, cur, torch.ones_like(cur)), gen)
            picks.append(x)
            qs.append(cur)
            cur = cur.scatter(-1, x[:, None], 0.0)
            cur = torch.where(cur.sum(-1, keepdim=True) > 0, cur / cur.sum(-1, keepdim=True).clamp(min=1e-30), 0 * cur)
        kids = torch.stack(picks, 1)
        kid_q = torch.stack(qs, 1) if told == "as_drawn" else q_root[:, None].expand(B, W, V)
    grand_q = tq[kids]  # [B, W, V]
    grand = grand_q.argmax(-1) if mode == "topk" else _multi(grand_q.reshape(-1, V), gen).view(B, W)
    tokens = torch.cat([prev[:, None], kids, grand], 1)  # [B, 1 + 2W]: root, children, grandchildren
    n_kids = torch.randint(2, W + 1, (B, 1), generator=gen)  # 2 or 3: every row has a sibling to fall back on
    slot = torch.arange(W)[None, :]
    children = torch.full((B, 1 + 2 * W, W), -1, dtype=torch.long)
    children[:, 0] = torch.where(slot < n_kids, 1 + slot, -1)
    has_grand = (torch.rand(B, W, generator=gen) < 0.5) & (slot < n_kids)
    children[:, 1:1 + W, 0] = torch.where(has_grand, 1 + W + slot, -1)
    q = None
    if mode != "topk" or told != "as_drawn":
        q = torch.cat([torch.zeros(B, 1, V), kid_q, grand_q], 1)
    v = verify.verify_tree(P_LOGITS[tokens], tokens, children, params, q, gen)
    emitted = torch.cat([tokens.gather(1, v.path.clamp(min=0))[:, :2], torch.zeros(B, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, v.accepted[:, None], v.next_token[:, None])
    return emitted, v.accepted + 1


def sample_window(step, B: int, seed: int = 0) -> torch.Tensor:
    """[B, L] windows sampled by calling step(prev [B], gen) -> (emitted, count) until all are full."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(B, L, dtype=torch.long)
    filled = torch.zeros(B, dtype=torch.long)
    prev = torch.zeros(B, dtype=torch.long)
    rows = torch.arange(B)[:, None]
    while (filled < L).any():
        emitted, count = step(prev, gen)
        j = torch.arange(emitted.shape[1])[None, :]
        pos = filled[:, None] + j
        ok = (j < count[:, None]) & (pos < L)
        out[rows.expand_as(pos)[ok], pos[ok]] = emitted[ok]
        prev = emitted.gather(1, (count - 1)[:, None]).squeeze(1)
        filled += count
    return out


def window_pvalue(samples: torch.Tensor, params) -> float:
    codes = samples @ (V ** torch.arange(L - 1, -1, -1))
    return chi2_pvalue(torch.bincount(codes, minlength=V ** L), exact_law(params))
