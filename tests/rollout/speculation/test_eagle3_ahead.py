"""The learned drafter's chains looked ahead (rollout/chains_ahead.py, Eagle3Drafter.propose_ahead; on by default on
CUDA, switched on here with the CUDA path's emulated graphs and early catch-up): each chain's successor is drafted from
the early catch-up's outputs at the rows' lengths on the device and launched before the host reads the step. Greedy
and keyed, the rollouts, drafts and acceptance are the step-by-step loop's (keyed, the sampled drafts draw from the
keys too, purpose DRAFT: a sample's drafts are its own whatever its batch); sampled, the samples keep the target's
exact law, which drafts keyed like the acceptance tests break."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.chains_ahead import AheadChains
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.law_helpers import ALPHA, engine_samples, hf_exact_law, make_law_model, sequence_pvalue
from tests.rollout.test_chains_ahead import accept_stats, trap_device_reads
from tests.rollout.test_engine_spec import multi_accepted

PROMPTS = dict(n=8, lo=4, hi=10, seed=9)  # what the drafter below trained on: it accepts ~0.8 tokens a verify


@pytest.fixture(scope="module")
def trained():
    return train_drafter()


def train_drafter():
    """A tiny target and an EAGLE-3 drafter trained for 150 steps on its greedy rollouts of PROMPTS (~2 s)."""
    hf = make_tiny_hf("llama", seed=9)
    eng = engine(hf, None, look_ahead=False, rows=16)
    drafter = eng.speculation.learned
    trainer = eng.speculation.attach_trainer(DrafterTrainer(drafter, lr=3e-3, batch=8, window=32, min_tokens=64,
                                                            publish_every=50))
    eng.generate(random_prompts(**PROMPTS), SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
    trainer.train_steps(150)
    drafter.swap_latest()
    return hf, drafter.state_dict()


def engine(hf, state, look_ahead: bool, rows: int, eos=(), device: str = "cpu", **kw) -> RolloutEngine:
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=4, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf, device=device), None, spec=spec, eos_token_ids=list(eos),
                        max_num_seqs=rows, **kw)
    drafter = eng.speculation.learned
    if device == "cpu":  # the CUDA path: level graphs (emulated), the catch-up before the read
        drafter.graph_mode, drafter.early = "emulate", True
    if state is not None:
        drafter.load_state_dict(state)
    eng.speculation.force(Arm("eagle3", 4))
    eng.look_ahead = look_ahead
    return eng


def spy_ahead(monkeypatch) -> dict:
    """Counts, per chain step that could have had a successor, whether one was launched, with rows that had ended
    riding along, and the learned drafter's proposals for a step launched ahead (not those it declined: a step in
    front that drafted nothing ran no early catch-up)."""
    seen = {"launched": 0, "refused": 0, "carried": 0, "proposals": 0}
    real, propose = AheadChains._chain_ahead, Eagle3Drafter.propose_ahead

    def chain_ahead(self, live, *a):
        out = real(self, live, *a)
        seen["launched" if out is not None else "refused"] += 1
        seen["carried"] += out is not None and any(s.finished for s in live)
        return out

    def proposed(self, *a):
        out = propose(self, *a)
        seen["proposals"] += out is not None
        return out

    monkeypatch.setattr(AheadChains, "_chain_ahead", chain_ahead)
    monkeypatch.setattr(Eagle3Drafter, "propose_ahead", proposed)
    return seen


@pytest.mark.parametrize("keyed", [False, True], ids=["greedy", "keyed-T1"])
def test_chains_looked_ahead_give_the_step_by_step_rollouts(trained, keyed, monkeypatch):
    assert_same_rollouts(*trained, "cpu", keyed, monkeypatch)


def assert_same_rollouts(hf, state, device: str, keyed: bool, monkeypatch) -> None:
    """8 samples on 6 rows (prompts wait), rows ending by a stop token and by length, greedy or sampled with keyed
    draws (the drafts too: `_uniforms`): the looked-ahead rollouts equal the step-by-step ones in every token and
    finish reason, logprobs to rounding, with the same acceptance statistics (the same drafts), one host transfer a
    step and no blocking copy; most chain steps were launched ahead, drafted by the learned drafter there, and rows
    that had ended rode along. (tests/gpu/test_cuda_eagle3_ahead.py: the same on CUDA, its graphs replayed.)"""
    prompts, keys = random_prompts(**PROMPTS), list(range(100, 100 + PROMPTS["n"])) if keyed else None
    params = SamplingParams(temperature=1.0 if keyed else 0.0, max_new_tokens=40)
    free = engine(hf, state, False, 6, device=device).generate(prompts, params, sample_keys=keys)
    rows = [r.completion_ids for r in free]
    # a stop token past the start of some rows and absent from others: rows end early, and by length
    stop = next(t for t in rows[0][8:] if sum(t in r for r in rows) < len(rows) // 2)
    plain = engine(hf, state, False, 6, eos=[stop], device=device)
    want = plain.generate(prompts, params, sample_keys=keys)
    seen = spy_ahead(monkeypatch)
    ahead = engine(hf, state, True, 6, eos=[stop], device=device)
    got = ahead.generate(prompts, params, sample_keys=keys)
    assert [(r.completion_ids, r.finish_reason) for r in got] == [(r.completion_ids, r.finish_reason) for r in want]
    torch.testing.assert_close([r.logprobs for r in got], [r.logprobs for r in want], rtol=0, atol=1e-5)
    assert {r.finish_reason for r in got} == {"stop", "length"}
    steps = len(ahead.batch_trace) - len(plain.batch_trace)  # a row's end is learned a step late
    assert ahead.runner.transfers.counts["d2h"] - plain.runner.transfers.counts["d2h"] == steps >= 0
    assert ahead.runner.transfers.counts["h2d_blocking"] == 0
    stats = accept_stats(ahead)
    assert stats == accept_stats(plain) and stats["rollout/accept_len"] > 1.4, stats
    assert seen["launched"] > 2 * seen["refused"] and seen["proposals"] == seen["launched"], seen
    assert seen["carried"] > 0, seen


def test_a_key_draws_the_same_sample_whatever_its_batch(trained, monkeypatch):
    """With per-sample keys the sampled drafts draw from them too (purpose DRAFT): a key's sample, drafted on every
    step and multi-token drafts accepted, is the same alone, among other prompts' samples and with n = 3 (step by
    step, and looked ahead). Its drafts drawn from the call's generator instead (the target's draws still keyed),
    the batch changes the drafts, and so the sample."""
    hf, state = trained
    prompts = random_prompts(**PROMPTS)
    mine, others = prompts[0], prompts[1:]
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=0)

    def sample(look_ahead: bool, batch: list, n: int, keys: list[int], at: int) -> list[int]:
        eng = engine(hf, state, look_ahead, 8)
        out = eng.generate(batch, SamplingParams(**{**params.__dict__, "n": n}), sample_keys=keys)
        stats = accept_stats(eng)
        assert multi_accepted(stats) > 0, stats
        return out[at].completion_ids

    alone = sample(False, [mine], 1, [77], 0)
    assert sample(False, others[:3] + [mine], 1, [5, 6, 7, 77], 3) == alone
    assert sample(False, [others[0], mine], 3, [1, 2, 3, 4, 77, 5], 4) == alone
    assert sample(True, others[:3] + [mine], 1, [5, 6, 7, 77], 3) == alone
    monkeypatch.setattr(Eagle3Drafter, "_uniforms", lambda self, *a: None)
    assert sample(False, others[:3] + [mine], 1, [5, 6, 7, 77], 3) != sample(False, [mine], 1, [77], 0)


def test_drafting_ahead_reads_nothing_back_from_the_device(trained, monkeypatch):
    """The learned drafter's proposal for a successor, its features' staging and its early catch-up read no device
    value on the host while the successor is launched (tests/rollout/test_chains_ahead.py's trap), and the rollouts
    are still the step-by-step ones."""
    hf, state = trained
    prompts, params = random_prompts(**PROMPTS), SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    want = [r.completion_ids for r in engine(hf, state, False, 8).generate(prompts, params)]
    trap_device_reads(monkeypatch)
    seen = spy_ahead(monkeypatch)
    assert [r.completion_ids for r in engine(hf, state, True, 8).generate(prompts, params)] == want
    assert seen["proposals"] > 10, seen


def test_the_trainer_banks_the_step_by_step_samples(trained):
    """With a trainer whose loss reads the target's top-k law (staged as each looked-ahead step is launched, over all
    its nodes), every finished sample banks the features and laws the step-by-step loop banks."""
    hf, state = trained

    def banked(look_ahead: bool) -> dict:
        eng, got = engine(hf, state, look_ahead, 6), {}
        trainer = DrafterTrainer(eng.speculation.learned, publish_every=10**6)
        assert trainer.topk > 0  # the default loss distils from the staged law
        trainer.add = lambda feats, ids, version, dist, temp: got.__setitem__(tuple(ids), (feats, dist))
        eng.speculation.attach_trainer(trainer)
        eng.generate(random_prompts(**PROMPTS), SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
        return got

    want, got = banked(False), banked(True)
    assert got.keys() == want.keys() and len(got) == PROMPTS["n"]
    for ids, (feats, dist) in got.items():
        torch.testing.assert_close(feats, want[ids][0], rtol=0, atol=1e-5)
        assert torch.equal(dist.has, want[ids][1].has) and dist.has[-20:].all()
        assert torch.equal(dist.ids[dist.has], want[ids][1].ids[dist.has])
        torch.testing.assert_close(dist.probs[dist.has], want[ids][1].probs[dist.has], rtol=0, atol=1e-3)


@pytest.mark.parametrize("stop", ["max_conf", "entropy"])
def test_stop_rule_chains_looked_ahead_give_the_step_by_step_rollouts(trained, stop, monkeypatch):
    """Chains cut by a stop rule: each looked-ahead row keeps its drafts before the first unsure one, a count the
    device works out and the step's transfer brings back. The rollouts, and the acceptance statistics over the drafts
    each row kept, are the step-by-step loop's (which reads the counts before the verify); the rule cut some
    looked-ahead chains and kept others whole."""
    hf, state = trained
    prompts, params = random_prompts(**PROMPTS), SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)

    def run(look_ahead: bool):
        eng = engine(hf, state, look_ahead, 6)
        with torch.no_grad():  # a sharper head: sure of some drafts, unsure of others (the same argmaxes)
            eng.speculation.learned.model.lm_head.weight.mul_(8.0)
        eng.speculation.force(Arm("eagle3", 4, 1, stop))
        return [r.completion_ids for r in eng.generate(prompts, params)], accept_stats(eng)

    want = run(False)
    seen, kept, propose = spy_ahead(monkeypatch), [], Eagle3Drafter.propose_ahead

    def spied(self, *a):
        out = propose(self, *a)
        kept.extend([] if out is None else out.kept.tolist())
        return out

    monkeypatch.setattr(Eagle3Drafter, "propose_ahead", spied)
    assert run(True) == want
    assert seen["launched"] > 10 and min(kept) < 4 and max(kept) == 4, (seen, sorted(set(kept)))


def test_look_ahead_under_preemption(trained, monkeypatch):
    """A pool so small that rows are preempted (the drafter forgets their KV and catches up again after the
    re-prefill): successors are launched only where every row has the blocks for them, greedy rollouts stay the
    plain ones, and every block comes back."""
    hf, state = trained
    prompts, params = random_prompts(**PROMPTS), SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    want = [r.completion_ids for r in engine(hf, None, False, 8).generate(prompts, params)]
    seen = spy_ahead(monkeypatch)
    eng = engine(hf, state, True, 8, max_model_len=128, kv_memory_gb=2e-4)  # ~a third of what the rows need
    assert [r.completion_ids for r in eng.generate(prompts, params)] == want
    assert eng.stats()["rollout/preemptions"] > 0 and seen["proposals"] > 0 and seen["refused"] > 0, seen
    assert eng.runner.cache.alloc.used == 0, "every block came back"


def test_no_look_ahead_with_new_weights_waiting(trained, monkeypatch):
    """A drafter with newer weights waiting (taken only between steps the host has read) steps one at a time."""
    hf, state = trained
    seen = spy_ahead(monkeypatch)
    monkeypatch.setattr(Eagle3Drafter, "_weights_waiting", lambda self: True)
    engine(hf, state, True, 4).generate(random_prompts(**PROMPTS)[:3],
                                        SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    assert seen["launched"] == seen["proposals"] == 0, seen


VOCAB, PROMPT, LENGTH, N = 8, [3, 4, 5, 1], 5, 10_000
TOP_P = SamplingParams(temperature=0.9, top_p=0.9)


@pytest.fixture(scope="module")
def law():
    hf = make_law_model(VOCAB, seed=0, std=0.3)
    return hf, hf_exact_law(hf, PROMPT, LENGTH, TOP_P)


def looked_ahead_pvalue(law, monkeypatch) -> tuple[float, dict, dict]:
    """10k keyed samples with every chain drafted by the learned drafter (sampled from q) and looked ahead where it
    can be -> (p-value against the exact law, engine stats, spy counts)."""
    hf, (seqs, probs, _) = law
    seen = spy_ahead(monkeypatch)

    def drafter(runtime):
        d = Eagle3Drafter(runtime, graph_mode="emulate")
        d.early = True
        return d

    torch.set_num_threads(1)  # 10k rows of small ops: a second thread only hands off
    samples, stats = engine_samples(hf, PROMPT, TOP_P, N, LENGTH, drafter, 1, 3, seed=4, keyed=True, look_ahead=True)
    return sequence_pvalue(samples, seqs, probs), stats, seen


def test_sampled_chains_looked_ahead_keep_the_law(law, monkeypatch):
    """T = 0.9, top-p 0.9, chains of 3: the samples' joint law over all 5 tokens is the target's (computed by
    transformers alone), with the successors' drafts drawn ahead on the device and multi-token drafts accepted in
    full among them. With each looked-ahead draft verified against its neighbour level's q, the samples fail it."""
    p, stats, seen = looked_ahead_pvalue(law, monkeypatch)
    assert p > ALPHA, p
    assert seen["launched"] > 0 and seen["proposals"] == seen["launched"], seen
    assert stats.get("rollout/accept_hist/2", 0.0) >= 0.03 and stats.get("rollout/accept_hist/3", 0.0) >= 0.005, stats

    real = AheadChains._launch_chain

    def q_a_level_off(self, live, arm, batch, drafted, *a):
        if drafted is None:  # launched ahead
            batch.q = batch.q.roll(1, dims=1)
        return real(self, live, arm, batch, drafted, *a)

    monkeypatch.setattr(AheadChains, "_launch_chain", q_a_level_off)
    assert looked_ahead_pvalue(law, monkeypatch)[0] <= ALPHA


def test_drafts_keyed_like_the_acceptance_tests_fail_the_law(law, monkeypatch):
    """The planted flaw: the drafts' purpose that of the chain's acceptance tests (ACCEPT), so draft j is drawn from
    the very uniform that then tests it (an accepted draft is likelier than min(1, p/q) says): the samples fail the
    law test that the keyed drafts pass (test_sampled_chains_looked_ahead_keep_the_law)."""
    from rlspec.rollout.runtime.draws import ACCEPT
    from rlspec.rollout.speculation.drafters import eagle3_draws

    monkeypatch.setattr(eagle3_draws, "DRAFT", ACCEPT)
    assert looked_ahead_pvalue(law, monkeypatch)[0] <= ALPHA
