"""Per-sample random keys (generate(sample_keys=...), rollout/runtime/draws.py): the laws they keep and the batch
invariance they buy.

  - the keyed uniforms are uniform and independent across positions, purposes, indices and neighbouring keys, and
    a keyed draw (torch's inverse CDF and the CPU kernel) has its distribution's law;
  - the engine's keyed samples keep the target's law: two tokens plain (a hash without the position, or keys taken
    from the KV row, fail the same test), five tokens through chains (the CPU op and the torch rule) and trees;
  - a key draws the same sample alone, in a batch, with another n, under preemption, stopped and carried on;
  - bad keys are refused.
Exact laws come from transformers' forward (law_helpers), never from rlspec.rollout.*.
"""
from __future__ import annotations

import pytest
import torch

import rlspec.rollout.decode as decode_mod
import rlspec.rollout.engine as engine_mod
import rlspec.rollout.runtime.draws as draws
import rlspec.rollout.speculation.verify as verify
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.draws import ACCEPT, FINAL, TREE, KeyedDraws
from rlspec.rollout.runtime.model import kernels, loader
from rlspec.rollout.runtime.sampling import sample, sample_plain
from rlspec.rollout.speculation.drafters.base import Draft
from rlspec.rollout.types import Carried, PartialRound, SamplingParams
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.law_helpers import (ALPHA, chi2_pvalue, hf_exact_law, make_law_model, one_thread,  # noqa: F401
                                       sequence_pvalue, spy_siblings)
from tests.rollout.spec_helpers import ScriptedDrafter
from tests.rollout.test_engine_spec import LAW_PROMPT, law_setup, likeliest_path, multi_accepted, spec_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def keys_for(n: int, start: int = 12345) -> list[int]:
    return [start + 7919 * i for i in range(n)]


def grid_pvalue(a: torch.Tensor, b: torch.Tensor, bins: int = 8) -> float:
    """Chi-square of the pairs (a, b) of uniforms over a bins x bins grid against independence."""
    cell = (a * bins).long() * bins + (b * bins).long()
    return chi2_pvalue(torch.bincount(cell, minlength=bins * bins).double(),
                       torch.full((bins * bins,), 1.0 / bins**2, dtype=torch.float64))


# ---- the hash --------------------------------------------------------------------------------------------------
def test_keyed_uniforms_are_uniform_and_independent():
    """Sequential keys (the hardest input for a weak hash): each uniform is uniform on a 2**-24 grid in [0, 1), and
    pairs that differ in the position, the index, the purpose or the key by one are independent."""
    n = 40000
    keys, pos = list(range(n)), [5] * n
    d = KeyedDraws("cpu", keys)
    a = d.bind(keys, pos).uniform((n, 2), FINAL)
    c = d.uniform((n, 1), ACCEPT)[:, 0]
    b = d.bind(keys, [6] * n).uniform((n, 1), FINAL)[:, 0]
    u = a[:, 0]
    assert 0 <= float(u.min()) and float(u.max()) < 1 and torch.equal(u * 2**24, (u * 2**24).floor())
    assert chi2_pvalue(torch.bincount((u * 64).long(), minlength=64).double(),
                       torch.full((64,), 1 / 64, dtype=torch.float64)) > ALPHA
    for other in (b, a[:, 1], c):  # position + 1, index + 1, another purpose
        assert grid_pvalue(u, other) > ALPHA
    assert grid_pvalue(u[:-1], u[1:]) > ALPHA  # key + 1
    with pytest.raises(AssertionError, match="drawn twice"):  # a site taking the same uniforms again
        d.uniform((n, 1), FINAL)
    with pytest.raises(AssertionError, match="rows"):
        d.uniform((n - 1, 1), TREE)


def test_hash_is_its_documented_formula_in_python_ints():
    """The hash in plain Python integers (what docs/verification.md#per-sample-keys states), at the extremes of
    its inputs: the int64 torch ops never overflow, so any device computes these exact values."""
    M = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = x * 0x7FEB352D & M
        x ^= x >> 15
        x = x * 0x31848BAB & M
        return x ^ x >> 16

    def ref(key, pos, purpose, index):
        h = mix(mix(mix((key & M) ^ 0x9E3779B9) ^ key >> 32) ^ pos & M)
        return (mix(h ^ (purpose << 24 | index)) >> 8) / 2**24

    keys, pos = [0, 1, 2**32 - 1, 2**32, 2**62 - 1, 987654321987654321], [0, 1, 7, 2**31 - 1, 4096, 123]
    got = KeyedDraws("cpu", keys).bind(keys, pos).uniform((len(keys), 3), TREE)
    want = [[ref(k, p, TREE, i) for i in range(3)] for k, p in zip(keys, pos)]
    assert got.tolist() == want


def test_a_keyed_draw_has_its_distributions_law():
    """40000 draws, each of its own random 62-bit key and position, from one distribution with zero cells: torch's
    inverse CDF (sample) and the CPU kernel (sample_plain, softmax(logits / T) in float64 apart) fit it."""
    n = 40000
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**62, (n,), generator=g).tolist()
    pos = torch.randint(0, 4096, (n,), generator=g).tolist()
    assert len(set(keys)) == n
    probs = torch.tensor([0.3, 0.0, 0.05, 0.4, 0.2, 0.0, 0.04, 0.01])
    tok = sample(probs.expand(n, -1), KeyedDraws("cpu", keys).bind(keys, pos))
    assert chi2_pvalue(torch.bincount(tok, minlength=8).double(), probs.double()) > ALPHA
    if not kernels.available():
        pytest.skip("the CPU kernels are not built")
    logits = torch.randn(8, generator=g) * 2
    params = SamplingParams(temperature=0.8)
    tok, row = sample_plain(logits.expand(n, -1).contiguous(), params, KeyedDraws("cpu", keys).bind(keys, pos))
    assert bool((row[:, 2] == 0).all())  # the finite column: 0 where finite
    assert chi2_pvalue(torch.bincount(tok, minlength=8).double(), torch.softmax(logits.double() / 0.8, -1)) > ALPHA


# ---- the engine's law ------------------------------------------------------------------------------------------
V, PROMPT, N = 6, [3, 4, 5, 1], 4000


@pytest.fixture(scope="module")
def two_tokens():
    hf = make_law_model(V, seed=0, std=0.4)
    seqs, probs, _ = hf_exact_law(hf, PROMPT, 2, SamplingParams(temperature=1.0))
    return hf, seqs, probs


def engine_pvalue(hf, seqs, probs) -> float:
    """N keyed two-token samples of PROMPT through 64 rows (each row serves ~60 samples one after another)."""
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[], max_num_seqs=64)
    out = eng.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_new_tokens=2, seed=0),
                       sample_keys=keys_for(N))
    return sequence_pvalue(torch.tensor([r.completion_ids for r in out]), seqs, probs)


def test_keyed_engine_samples_have_the_two_token_law(two_tokens):
    assert engine_pvalue(*two_tokens) > ALPHA


def test_a_hash_without_the_position_fails_the_two_token_law(two_tokens, monkeypatch):
    """The planted flaw: every position of a sample draws the same uniform (both tokens from one u)."""
    real = draws.row_state
    monkeypatch.setattr(draws, "row_state", lambda keys, positions: real(keys, torch.zeros_like(positions)))
    assert engine_pvalue(*two_tokens) <= ALPHA


def test_keys_from_the_kv_row_fail_the_two_token_law(two_tokens, monkeypatch):
    """The planted flaw: draws keyed by the KV row a sample holds (the key of the row's first sample), so the
    samples a row serves in turn repeat."""
    first: dict[int, int] = {}

    def by_row(d, seqs, ahead=0):
        return d.bind([first.setdefault(s.row, s.key) for s in seqs], [len(s.completion_ids) + ahead for s in seqs])

    monkeypatch.setattr(engine_mod, "bound", by_row)  # the prefill's draws
    monkeypatch.setattr(decode_mod, "bound", by_row)  # the decode steps'
    assert engine_pvalue(*two_tokens) <= ALPHA


@pytest.mark.parametrize("temperature,top_p,width", [(1.0, 1.0, 1), (0.7, 0.8, 1), (1.0, 1.0, 2)],
                         ids=["T1-chain-op", "T0.7-top_p0.8-chain-torch", "T1-tree"])
def test_keyed_speculation_keeps_the_law(temperature, top_p, width, monkeypatch):
    """Five tokens with drafts of 0-3 tokens on every step (test_engine_spec's setting) and keyed draws: the joint
    law is the target's; multi-token drafts were accepted; chains at T 1 ran through the CPU op, trees had their
    first child, a later one and none accepted."""
    hf, params, seqs, probs, ranked = law_setup(temperature, top_p, 3000)
    seen, real_op, ops = spy_siblings(monkeypatch), verify._chain_op, []
    monkeypatch.setattr(verify, "_chain_op", lambda *a: ops.append(real_op(*a)) or ops[-1])
    drafter = ScriptedDrafter(V, lambda seq, n: likeliest_path(ranked, seq.completion_ids, n), corrupt=0.5,
                              tree=width > 1)
    eng = spec_engine(hf, drafter, width=width, k=3, max_num_seqs=3000)
    eng.eos_token_ids = set()
    out = eng.generate([LAW_PROMPT], params, sample_keys=keys_for(3000))
    assert sequence_pvalue(torch.tensor([r.completion_ids for r in out]), seqs, probs) > ALPHA
    stats = eng.stats()
    assert drafter.multi >= 1500 and multi_accepted(stats) >= 0.005, (drafter.multi, stats)
    if width == 1 and top_p == 1.0 and kernels.available():
        assert sum(v is not None for v in ops) >= 3
    if width > 1:
        assert min(seen["first"], seen["later"], seen["none"]) >= 100, seen


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)],
                         ids=["T1-chain-op", "T0.7-top_p0.8-chain-torch"])
def test_acceptance_and_final_draws_sharing_uniforms_fail_the_chain_law(temperature, top_p, monkeypatch):
    """The planted flaw: the purpose left out of the hash, so a chain's next token reuses draft 0's acceptance
    uniform (docs/verification.md: given a rejection, that uniform is no longer uniform). The torch rule tests and
    then draws only for drafts described by a q (a deterministic draft is one draw a position, with no second
    purpose to collide with): the drafts carry their one-hot q there."""
    def purposeless(self, shape, purpose):
        word = self.offset + torch.arange(shape[1] if len(shape) > 1 else 1, dtype=torch.int64)
        return draws.to_uniform(draws.mix32(self.state[:, None] ^ word[None, :])).reshape(shape)

    monkeypatch.setattr(KeyedDraws, "uniform", purposeless)
    hf, params, seqs, probs, ranked = law_setup(temperature, top_p, 3000)
    drafter = ScriptedDrafter(V, lambda seq, n: likeliest_path(ranked, seq.completion_ids, n), corrupt=0.5,
                              one_hot_q=top_p < 1.0)
    eng = spec_engine(hf, drafter, k=3, max_num_seqs=3000)
    eng.eos_token_ids = set()
    out = eng.generate([LAW_PROMPT], params, sample_keys=keys_for(3000))
    assert sequence_pvalue(torch.tensor([r.completion_ids for r in out]), seqs, probs) <= ALPHA


# ---- batch invariance ------------------------------------------------------------------------------------------
class GreedyPathDrafter:
    """Drafts the HF model's greedy continuation of the row's own tokens (width 2: the second likeliest token as a
    root sibling): a function of the sequence alone, so a batch cannot change a row's drafts."""

    name = "scripted"

    def __init__(self, hf):
        self.hf, self.multi = hf, 0

    def begin(self, groups) -> None:
        pass

    def finish(self, seq) -> None:
        pass

    def propose(self, seqs, max_tokens, width):
        out = []
        for s, cap in zip(seqs, max_tokens):
            ids, chain, second = s.all_ids(), [], None
            for _ in range(cap - (width > 1 and cap >= 2)):
                with torch.no_grad():
                    top = self.hf(torch.tensor([ids + chain])).logits[0, -1].topk(2).indices.tolist()
                second = top[1] if second is None else second
                chain.append(top[0])
            self.multi += len(chain) >= 2
            tree = width > 1 and cap >= 2
            out.append(Draft(chain + [second], list(range(-1, len(chain) - 1)) + [-1]) if tree else Draft.chain(chain))
        return out


def tracked(eng, prompts, n, keys, at, seed=0, temperature=1.0) -> list[int]:
    params = SamplingParams(temperature=temperature, max_new_tokens=14, n=n, seed=seed, ignore_eos=True)
    return eng.generate(prompts, params, sample_keys=keys)[at].completion_ids


@pytest.mark.parametrize("width", [0, 1, 2], ids=["plain", "chain", "tree"])
def test_a_key_draws_the_same_sample_whatever_its_batch(width):
    """One key: alone; among other prompts' samples (another call seed, which keys ignore); with n = 3 per prompt;
    plain decoding also in a KV pool small enough to preempt. Speculation (every step, drafts that depend on the row
    alone) gives the same sample in every batch, and accepted multi-token drafts. Without keys the call's generator
    gives the sample another token somewhere: the same comparison fails."""
    hf = make_tiny_hf("llama", seed=3)
    drafter = GreedyPathDrafter(hf) if width else None
    eng = spec_engine(hf, drafter, width=width, k=3) if width else \
        RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    mine, others, t = [1, 5, 9, 14], random_prompts(5, 3, 9, seed=1), 0.5 if width else 1.0  # peaked: drafts pass
    alone = tracked(eng, [mine], 1, [77], 0, temperature=t)
    assert tracked(eng, others[:2] + [mine] + others[2:], 1, [5, 6, 77, 8, 9, 10], 2, 3, t) == alone
    assert tracked(eng, [others[0], mine], 3, [1, 2, 3, 4, 77, 5], 4, temperature=t) == alone
    if width:
        assert drafter.multi > 0 and multi_accepted(eng.stats()) > 0
    else:
        small = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], kv_block_size=4,
                              kv_memory_gb=12 * 2 * 2 * 4 * 2 * 16 * 4 / 2**30)  # 12 blocks of 4
        assert tracked(small, others + [mine], 2, list(range(10, 20)) + [77, 20], 10) == alone
        assert small.stats()["rollout/preemptions"] > 0
    params = SamplingParams(temperature=t, max_new_tokens=14, seed=0, ignore_eos=True)
    plain_alone = eng.generate([mine], params)[0].completion_ids
    assert eng.generate(others[:2] + [mine], params)[2].completion_ids != plain_alone


@pytest.mark.parametrize("width", [0, 1], ids=["plain", "chain"])
def test_a_stopped_and_carried_sample_is_the_uninterrupted_one(width):
    """A partial round stopped after 1, 3 or 6 decode steps and carried on (the weights pushed again unchanged)
    gives exactly the uninterrupted keyed samples, while the other samples of the round differ in number."""
    hf = make_tiny_hf("llama", seed=5)
    eng = spec_engine(hf, GreedyPathDrafter(hf), k=3) if width else \
        RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    prompts, keys = random_prompts(3, 3, 8, seed=2), [40, 41, 42, 43, 44, 45]
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=0, ignore_eos=True)
    straight = [r.completion_ids for r in eng.generate(prompts, params, sample_keys=keys)]
    for stop in (1, 3, 6):
        part = eng.generate(prompts, params, sample_keys=keys,
                            partial=PartialRound([[None, None]] * 3, stop_after_groups=0, min_decode_steps=stop))
        assert all(r.finish_reason == "partial" for r in part)
        eng.load_weights(hf.named_parameters())
        # carry the first prompt's samples on with a fresh sample beside them; the others are left behind
        going = PartialRound([[Carried(part[0].completion_ids, part[0].logprobs),
                               Carried(part[1].completion_ids, part[1].logprobs), None]], stop_after_groups=1)
        rest = eng.generate(prompts[:1], params, sample_keys=[40, 41, 999], partial=going)
        assert [r.completion_ids for r in rest[:2]] == straight[:2]


def test_greedy_ignores_keys():
    hf = make_tiny_hf("llama", seed=6)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    prompts, params = random_prompts(3, 3, 8, seed=3), SamplingParams(temperature=0, max_new_tokens=16)
    assert [r.completion_ids for r in eng.generate(prompts, params, sample_keys=[3, 1, 2])] == \
        [r.completion_ids for r in eng.generate(prompts, params)]


# ---- errors ----------------------------------------------------------------------------------------------------
def test_bad_keys_are_refused_and_the_engine_stays_usable():
    hf = make_tiny_hf("llama", seed=6)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=0)
    prompts = [[1, 5], [1, 6]]
    with pytest.raises(ValueError, match=r"sample_keys\[1\] and sample_keys\[3\] are both 7"):
        eng.generate(prompts, params, sample_keys=[1, 7, 2, 7])
    with pytest.raises(ValueError, match="3 keys for 4 sequences"):
        eng.generate(prompts, params, sample_keys=[1, 2, 3])
    with pytest.raises(ValueError, match="2 keys for 3 sequences"):  # a round: one key per listed sample
        eng.generate(prompts, params, sample_keys=[1, 2], partial=PartialRound([[None], [None, None]], 1))
    for bad in (-1, 2**62, 1.0, True):
        with pytest.raises(ValueError, match=r"sample_keys\[2\] is .*int in \[0, 2\*\*62\)"):
            eng.generate(prompts, params, sample_keys=[1, 2, bad, 3])
    assert len(eng.generate(prompts, params, sample_keys=[0, 2**62 - 1, 5, 6])) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_keyed_draws_are_the_same_on_cuda_and_the_engine_there_is_batch_invariant():
    """The hash on the GPU gives the CPU's bits; a CUDA engine (graphs on) draws a key's sample alone as in a batch."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(0, 2**62, (5000,), generator=g).tolist()
    pos = torch.randint(0, 9999, (5000,), generator=g).tolist()
    cpu = KeyedDraws("cpu", keys).bind(keys, pos).uniform((5000, 4), ACCEPT)
    assert torch.equal(KeyedDraws("cuda", keys).bind(keys, pos).uniform((5000, 4), ACCEPT).cpu(), cpu)
    hf = make_tiny_hf("llama", seed=3)
    eng = RolloutEngine(loader.from_hf_model(hf, device="cuda"), None, eos_token_ids=[2])
    mine, others = [1, 5, 9, 14], random_prompts(5, 3, 9, seed=1)
    alone = tracked(eng, [mine], 1, [77], 0)
    assert tracked(eng, others[:2] + [mine] + others[2:], 1, [5, 6, 77, 8, 9, 10], 2, 3) == alone
