"""Known-wrong verifiers, each caught by the verify-level law test that the real verifier passes.

Every flaw runs the same harness, sample size, seed and threshold (ALPHA) as
test_verify.py::test_real_verifier_keeps_target_law, so a passing real verifier and a failing flaw
are the same test with one rule changed: this is what shows the law test has the power to see
these bugs. The flaws replace one helper of rollout.speculation.verify, wrap a verify function (changing
what it is given or what it returns), or change what the drafter tells the verifier.
"""
import pytest
import torch

import rlspec.rollout.speculation.verify as verify
from rlspec.rollout.runtime.draws import NODE
from rlspec.rollout.runtime.sampling import probs_from_logits, sample
from rlspec.rollout.types import SamplingParams
from tests.rollout.law_helpers import ALPHA
from tests.rollout.speculation.markov import V, window_pvalue
from tests.rollout.speculation.test_verify import _threads, one_thread, run  # noqa: F401  (fixtures)

REAL_CHAIN = verify.verify_chain
T1 = SamplingParams(temperature=1.0)


def _lenient(u, p, q_x, x):
    """min(1, 1.1 p/q): a "harmless" 10% lenience."""
    return u * q_x < 1.1 * p.gather(-1, x[..., None]).squeeze(-1)


def _greedy_compare(u, p, q_x, x):
    """Sampled drafts compared greedily: accept x iff it is argmax p."""
    return x == p.argmax(-1)


def _q_rows(q, drafts, idx):
    """[B, V]: the q draft idx[b] was verified against (one-hot when deterministic)."""
    rows = torch.arange(len(drafts))
    if q is not None:
        return q[rows, idx]
    return torch.zeros(len(drafts), V).scatter_(-1, drafts[rows, idx][:, None], 1.0)


def _bonus_wrong_position(logits, drafts, num, params, q=None, gen=None):
    """After a fully accepted draft the bonus is drawn from p at the last draft's position (p_{k-1})
    instead of p_k: the logits at position num are replaced by those one before."""
    rows = torch.arange(len(num))
    shifted = logits.clone()
    shifted[rows, num] = logits[rows, (num - 1).clamp(min=0)]
    return REAL_CHAIN(shifted, drafts, num, params, q, gen)


def _bonus_from_residual(logits, drafts, num, params, q=None, gen=None):
    """After a fully accepted draft the bonus is drawn from norm(max(0, p_k - q_{k-1})), as if the
    last draft had been rejected, instead of from p_k."""
    v = REAL_CHAIN(logits, drafts, num, params, q, gen)
    rows = torch.arange(len(num))
    p = probs_from_logits(logits, params)
    full = (v.accepted == num) & (num > 0)
    last = (num - 1).clamp(min=0)
    wrong = sample(verify._residual(p[rows, num], _q_rows(q, drafts, last)), gen)
    return verify.Verdict(v.accepted, torch.where(full, wrong, v.next_token))


def _uniform_reused(logits, drafts, num, params, q=None, gen=None):
    """The residual after a rejection is sampled by inverting its CDF at the acceptance uniform of
    the rejected draft (which, given the rejection, is not uniform) instead of at a fresh one."""
    state = gen.get_state()
    v = REAL_CHAIN(logits, drafts, num, params, q, gen)
    B, K = drafts.shape
    u = torch.rand(B, K, generator=torch.Generator().set_state(state))  # verify_chain's first draw
    rows = torch.arange(B)
    p = probs_from_logits(logits, params)
    q_x = torch.ones(B, K) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    ok = (u * q_x < p[:, :K].gather(-1, drafts[..., None]).squeeze(-1)) & (torch.arange(K) < num[:, None])
    assert torch.equal(ok.long().cumprod(-1).sum(-1), v.accepted)  # the replay saw the verifier's uniforms
    at = v.accepted.clamp(max=K - 1)
    cdf = verify._residual(p[rows, v.accepted], _q_rows(q, drafts, at)).cumsum(-1)
    reused = torch.searchsorted(cdf, (u[rows, at] * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    return verify.Verdict(v.accepted, torch.where(v.accepted < num, reused, v.next_token))


def _padding_verified(logits, drafts, num, params, q=None, gen=None):
    """Ragged rows ignored: every row is verified as if it had drafted K tokens, padding included."""
    return REAL_CHAIN(logits, drafts, torch.full_like(num, drafts.shape[1]), params, q, gen)


def _fresh_p_residual(p, xs, qs, valid, generator):
    """verify._recursive_reject with one change: each rejection's residual is taken against the
    parent's fresh p instead of the running distribution."""
    B, W = xs.shape
    running, slot = p, torch.full((B,), -1, dtype=torch.long)
    u = torch.rand(B, W, generator=generator)
    for j in range(W):
        x = xs[:, j]
        q = qs[:, j]
        q_x = q.gather(-1, x[:, None]).squeeze(-1)
        tried = valid[:, j] & (slot < 0) & (q_x > 0)
        ok = tried & verify._accept(u[:, j], running, q_x, x)
        slot = torch.where(ok, j, slot)
        running = torch.where((tried & ~ok)[:, None], verify._residual(p, q), running)  # the flaw: p
    return slot, running


def _next_token_drawn_afresh(logits, drafts, num, params, q=None, gen=None):
    """Deterministic drafts: after a rejection the next token is a fresh draw from p there instead of the draw that
    rejected the draft (so a draft's token can follow its own rejection)."""
    v = REAL_CHAIN(logits, drafts, num, params, q, gen)
    rows = torch.arange(len(num))
    fresh = sample(probs_from_logits(logits, params)[rows, v.accepted], gen)
    return verify.Verdict(v.accepted, torch.where(v.accepted < num, fresh, v.next_token), v.exact)


REAL_TREE = verify.verify_tree


def _stop_token_drawn_afresh(logits, tokens, children, params, q=None, gen=None, depth=None):
    """Deterministic children: where the walk stops at a node with children, the next token is a fresh draw from
    p there instead of the draw that matched no child (so a child's token can follow its own rejection)."""
    v = REAL_TREE(logits, tokens, children, params, q, gen, depth)
    rows = torch.arange(len(tokens))
    cur = torch.cat([torch.zeros(len(tokens), 1, dtype=torch.long), v.path], 1).gather(1, v.accepted[:, None])[:, 0]
    fresh = sample(probs_from_logits(logits, params)[rows, cur], gen)
    return verify.TreeVerdict(v.path, v.accepted, torch.where((children[rows, cur] >= 0).any(-1), fresh, v.next_token))


def _one_uniform_for_every_node(gen, shape, device, purpose):
    """Deterministic drafts: every node's (position's) draw inverts its CDF at the first one's uniform (draws along
    a path correlated) instead of one uniform per node."""
    u = REAL_UNIFORM(gen, shape, device, purpose)
    return u[:, :1].expand_as(u) if purpose == NODE else u


REAL_UNIFORM = verify.uniform
# name -> (drafts the harness makes, attribute of rollout.speculation.verify replaced, replacement, harness options)
FLAWS = {
    "chain/resample_from_p_after_rejection": ("sampled", "_residual", lambda p, q: p, {}),
    "chain/lenient_acceptance_1.1": ("sampled", "_accept", _lenient, {}),
    "chain/greedy_compare_of_sampled_drafts": ("sampled", "_accept", _greedy_compare, {}),
    "chain/bonus_from_last_draft_position": ("sampled", "verify_chain", _bonus_wrong_position, {}),
    "chain/bonus_from_residual": ("deterministic", "verify_chain", _bonus_from_residual, {}),
    "chain/acceptance_uniform_reused_for_residual": ("sampled", "verify_chain", _uniform_reused, {}),
    "chain/padding_drafts_verified": ("sampled", "verify_chain", _padding_verified, {}),
    "chain/deterministic_next_token_drawn_afresh": ("deterministic", "verify_chain", _next_token_drawn_afresh, {}),
    "chain/deterministic_one_uniform_for_every_position": ("deterministic", "uniform", _one_uniform_for_every_node,
                                                           {}),
    "chain/q_processed_at_another_temperature": ("sampled", None, None,
                                                 {"q_params": SamplingParams(temperature=0.6)}),
    "tree/resample_from_p_after_rejection": ("iid", "_residual", lambda p, q: p, {}),
    "tree/lenient_acceptance_1.1": ("iid", "_accept", _lenient, {}),
    "tree/residual_against_fresh_p_iid": ("iid", "_recursive_reject", _fresh_p_residual, {}),
    "tree/topk_stop_token_drawn_afresh": ("topk", "verify_tree", _stop_token_drawn_afresh, {}),
    "tree/topk_one_uniform_for_every_node": ("topk", "uniform", _one_uniform_for_every_node, {}),
    "tree/specinfer_iid_rule_on_topk_children": ("topk", None, None, {"told": "shared"}),
    "tree/iid_rule_on_without_replacement_children": ("wor", None, None, {"told": "shared"}),
}


@pytest.mark.parametrize("flaw", list(FLAWS))
def test_flawed_verifier_fails_the_law_test(monkeypatch, flaw):
    mode, name, broken, options = FLAWS[flaw]
    if name in ("_residual", "_accept", "uniform") or flaw.startswith("chain/deterministic"):
        # a flaw in the torch rule: chains take it, not the CPU kernel's
        monkeypatch.setattr(verify, "_chain_op", lambda *a: None)
    if name is not None:
        monkeypatch.setattr(verify, name, broken)
    assert window_pvalue(run(T1, mode, **options), T1) <= ALPHA
