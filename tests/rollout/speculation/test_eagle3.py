"""The learned EAGLE-3 drafter: lossless in the engine, incremental drafting equals a full pass, it learns."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model import kernels, loader
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.law_helpers import one_thread  # noqa: F401  (fixture of the law tests)


def eagle_engine(hf, width=1, k=4, force=True, **kw):
    # online_training off: each test drives its own DrafterTrainer synchronously
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=k, tree_width=width, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], **kw)
    if force:
        eng.speculation.force(Arm("eagle3", k, width))
    return eng


def plain(hf, prompts, params):
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    return [r.completion_ids for r in eng.generate(prompts, params)]


@pytest.mark.parametrize("width,stop", [(1, "none"), (2, "none"), (1, "max_conf"), (1, "entropy")])
def test_greedy_exact_with_cold_eagle3(width, stop, monkeypatch):
    """Greedy output of an untrained drafter equals plain decoding. Its head is scaled up (x8) so that its
    confidence varies (an untouched one is unsure everywhere and a stop rule would end every draft at once):
    with a stop rule some drafts run in full and others end early (counted), without one every draft is full."""
    hf = make_tiny_hf("llama", seed=6)
    prompts = random_prompts(6, 3, 20, seed=6)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    eng = eagle_engine(hf, width=width)
    with torch.no_grad():
        eng.speculation.learned.model.lm_head.weight.mul_(8.0)
    eng.speculation.force(Arm("eagle3", 4, width, stop))
    lengths, propose = Counter(), Eagle3Drafter.propose_tensors

    def counted(self, seqs, max_tokens, width):
        drafts = propose(self, seqs, max_tokens, width)
        lengths.update("full" if n == cap else "short" if n else "none" for cap, n in zip(max_tokens, drafts.counts())
                       if cap == 4 * width)  # rows with room for the whole draft
        return drafts

    monkeypatch.setattr(Eagle3Drafter, "propose_tensors", counted)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == plain(hf, prompts, params)
    assert eng.stats()["rollout/accept_len"] > 1.0  # drafts were verified and some accepted
    if stop == "none":
        assert lengths["full"] >= 50 and lengths["short"] + lengths["none"] == 0, lengths
    else:  # the rule ended some drafts early, and let others run in full
        assert min(lengths["full"], lengths["short"]) >= 5, lengths


def test_incremental_drafting_equals_full_pass():
    """The first draft after catch-up equals the drafter run over the whole sequence at once."""
    hf = make_tiny_hf("llama", seed=7)
    eng = eagle_engine(hf, k=2)
    captured = {}
    drafter: Eagle3Drafter = eng.speculation.learned
    orig = drafter._draft

    def spy(seqs, h, depth, width):
        out = orig(seqs, h, depth, width)
        ids = out[0]
        s = seqs[0]
        cache = drafter.target_cache
        slots = cache.slots(torch.tensor([s.row]), torch.arange(s.cache_len)[None])[0]
        captured.setdefault("cases", []).append((list(s.all_ids()), s.cache_len,
                                                 cache.read_side("eagle3/features", slots),
                                                 ids[0, 0, 0].item()))
        return out

    drafter._draft = spy
    prompt = random_prompts(1, 9, 9, seed=7)[0]
    eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    m, target = drafter.model, drafter.target
    for ids, n, feats, first in captured["cases"]:
        toks = torch.tensor(ids[1:n + 1])[None]
        causal = torch.ones(n, n, dtype=torch.bool).tril()

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)

        pos = torch.arange(n)
        cos, sin = target.rope_cos[pos][None, :, None], target.rope_sin[pos][None, :, None]
        with torch.no_grad():
            out = m(feats[None], target.model.embed_tokens(toks), cos, sin, attend)
        assert m.to_target(m.logits(out[0, -1]).argmax()).item() == first


def test_online_training_raises_acceptance_and_keeps_exactness():
    hf = make_tiny_hf("llama", seed=9)
    prompts = random_prompts(8, 4, 10, seed=9)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    eng = eagle_engine(hf, k=4)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=3e-3, batch=8, window=32, min_tokens=64, publish_every=50))
    ref = plain(hf, prompts, params)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    cold = eng.stats()["rollout/accept_len"]
    trainer.train_steps(150)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref  # swapped weights, still exact
    stats = eng.stats()
    assert stats["drafter/version"] >= 1 and stats["drafter/loss"] < 3.0
    assert stats["rollout/accept_len"] > cold + 0.5, (cold, stats["rollout/accept_len"])


def test_training_crash_keeps_engine_running(monkeypatch):
    hf = make_tiny_hf("llama", seed=10)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, min_tokens=1))
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    eng.generate(random_prompts(2, 4, 6), params)
    monkeypatch.setattr(trainer, "_step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    trainer.start()
    trainer.set_idle(True)
    trainer._thread.join(timeout=10)
    assert trainer.stats.error and "boom" in trainer.stats.error
    out = eng.generate(random_prompts(2, 4, 6), params)
    assert all(len(r.completion_ids) == 10 for r in out)
    assert eng.stats()["drafter/failed"] == 1.0
    trainer.stop()


def test_ttt_loss_is_finite_and_decreases():
    hf = make_tiny_hf("llama", seed=12)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, lr=3e-3, min_tokens=16, batch=4, window=16))
    eng.generate(random_prompts(4, 4, 8), SamplingParams(temperature=1.0, max_new_tokens=30, seed=0, ignore_eos=True))
    first = trainer.train_steps(1)
    last = trainer.train_steps(60)
    assert torch.isfinite(torch.tensor(first)) and last < first


@pytest.mark.parametrize("width,temperature,top_p", [(1, 1.0, 1.0), (1, 0.7, 0.8), (2, 1.0, 1.0)],
                         ids=["T1-chain", "T0.7-top_p0.8-chain", "T1-tree"])
def test_sampled_eagle3_drafts_keep_the_law(width, temperature, top_p, monkeypatch, one_thread):
    """At T > 0 the drafter samples from its own q and verification uses min(1, p/q) + residual: the joint law of
    five tokens (chains of up to three nodes: test_engine_spec.law_setup) equals transformers' own; trees (two
    root children, each with a child: four nodes) over six. Multi-token drafts were accepted; trees: a later
    sibling was accepted after the first was rejected, and paths two deep were accepted."""
    from tests.rollout.law_helpers import ALPHA, sequence_pvalue, spy_siblings
    from tests.rollout.test_engine_spec import LAW_LENGTH, LAW_N, LAW_PROMPT, law_setup, multi_accepted

    k = 3 if width == 1 else 4  # a draft holds at most min(k, tokens left - 1) nodes, width x depth for a tree
    hf, params, seqs, probs, _ = law_setup(temperature, top_p, LAW_N, length=LAW_LENGTH + (width > 1))
    seen = spy_siblings(monkeypatch)
    eng = eagle_engine(hf, width=width, k=k, max_num_seqs=LAW_N)
    eng.eos_token_ids = set()
    samples = torch.tensor([r.completion_ids for r in eng.generate([LAW_PROMPT], params)])
    assert sequence_pvalue(samples, seqs, probs) > ALPHA
    stats = eng.stats()
    assert multi_accepted(stats) >= 0.01, stats
    if width > 1:
        assert min(seen["first"], seen["later"], seen["none"]) >= 100, seen


@pytest.mark.parametrize("stop", ["max_conf", "entropy"])
def test_stop_rules_end_drafts_of_an_unsure_drafter(stop):
    """A drafter with a zeroed head is uniform (top-1 1/96, entropy ln 96): both rules stop at once,
    while without a rule the same drafter drafts every step."""
    hf = make_tiny_hf("llama", seed=6)
    eng = eagle_engine(hf)
    with torch.no_grad():
        eng.speculation.learned.model.lm_head.weight.zero_()
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = random_prompts(2, 4, 8)
    eng.generate(prompts, params)
    assert eng.stats()["rollout/spec_step_share"] > 0.8
    eng.speculation.force(Arm("eagle3", 4, 1, stop))
    assert [r.completion_ids for r in eng.generate(prompts, params)] == plain(hf, prompts, params)
    assert eng.stats()["rollout/spec_step_share"] == 0.0


def test_a_new_drafter_version_fades_the_selectors_evidence_rather_than_dropping_it():
    """The engine's side of the bandit rule: a version from the online trainer keeps part of the
    acceptance evidence (dropping it all sent the bandit back to its optimistic prior every step)."""
    from rlspec.rollout.speculation.selectors.base import OFF
    from rlspec.rollout.speculation.speculation import UPDATE_KEEP

    hf = make_tiny_hf("llama", seed=14)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="eagle3", selector="adaptive", online_training=False))
    spec = eng.speculation
    tracker = spec.selector.acceptance["eagle3"]
    tracker.accepts, tracker.rejects = 30.0, 10.0
    spec.learned.version += 1  # what swapping in a published version does
    spec.observe_step(OFF, 1, 0.01, 0.0, [0], [0])
    assert 0 < UPDATE_KEEP < 1
    kept = spec.selector.acceptance["eagle3"]
    assert (kept.accepts, kept.rejects) == (30.0 * UPDATE_KEEP, 10.0 * UPDATE_KEEP)


def test_draft_attention_equals_attention_over_context_and_drafts():
    """The draft steps' attention (context scored apart, in float32) equals one attention over the context
    and the draft keys concatenated, positions at or past each row's length hidden (they hold garbage)."""
    from rlspec.rollout.runtime.model.attention import attend_dense
    from rlspec.rollout.speculation.drafters.eagle3_draws import _DraftAttention

    g = torch.Generator().manual_seed(0)
    R, H, KV, D, S = 3, 6, 2, 16, 20
    lens = torch.tensor([20, 7, 13])
    ctx_k, ctx_v = torch.randn(R, KV, S, D, generator=g), torch.randn(R, KV, S, D, generator=g)
    attend = _DraftAttention(ctx_k, ctx_v, lens)
    keys, vals = [ctx_k.double()], [ctx_v.double()]
    for step in range(3):
        q = torch.randn(R, H, 1, D, generator=g)
        k, v = torch.randn(R, KV, 1, D, generator=g), torch.randn(R, KV, 1, D, generator=g)
        keys.append(k.double())
        vals.append(v.double())
        seen = torch.cat([torch.arange(S)[None] < lens[:, None], torch.ones(R, step + 1, dtype=torch.bool)], 1)
        ref = attend_dense(q.double(), torch.cat(keys, 2), torch.cat(vals, 2), seen[:, None, None])
        torch.testing.assert_close(attend(q, k, v).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="no AVX-512 BF16 CPU or no C++ toolchain")
def test_bf16_catch_up_attends_through_the_kernel(monkeypatch):
    """In bf16 on the CPU the catch-up reads the drafter's cached keys in place (paged_attention) and gives
    what gathering them gave, up to bf16 rounding, on every catch-up of a rollout."""
    from torch.profiler import ProfilerActivity, profile

    from rlspec.rollout.runtime.model import fused

    monkeypatch.setattr(fused, "enabled", False)  # the network's own step (the fused one: the next test)
    hf = make_tiny_hf("llama", seed=7, head_dim=32)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, online_training=False)
    # the target's steps eager: the catch-up is the drafter's, and compiling the target's would be seconds of C++
    eng = RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, spec=spec, eos_token_ids=[2],
                        compile_mode="off")
    eng.speculation.force(Arm("eagle3", 3, 1))
    real, usable, pairs = Eagle3Drafter._run_catch_up, kernels.attention_usable, []

    def both(self, *a):
        with monkeypatch.context() as m:
            m.setattr(kernels, "attention_usable", lambda q, pool: False)
            ref = real(self, *a)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = real(self, *a)
        pairs.append((out, ref, any(e.key == "rlspec_kernels::paged_attention" for e in prof.key_averages())))
        return out

    monkeypatch.setattr(Eagle3Drafter, "_run_catch_up", both)
    eng.generate(random_prompts(2, 6, 12, seed=7), SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    assert len(pairs) >= 5 and all(used for *_, used in pairs) and usable is kernels.attention_usable
    for got, ref, _ in pairs:
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.05)


@pytest.mark.skipif(not kernels.available(), reason="no AVX-512 BF16 CPU or no C++ toolchain")
def test_fused_draft_steps_are_the_networks(monkeypatch):
    """bf16 on the CPU: the catch-up runs as one fused layer op and a chain after it as one op (draft_chain.cpp).
    On every proposal of a rollout their outputs are the network's (eager, its draft keys held apart) up to bf16
    rounding: the catch-up's last output, and the logits of each draw (compared along each chain as far as the
    eager and fused greedy drafts agree, and at the first draw where they part, whose logits share a prefix); and
    decoding stays plain decoding's, token for token (the fused target step gives a token the same bits in a
    verify as alone, test_fused.py)."""
    from rlspec.rollout.speculation.drafters.eagle3_fused import FusedDraftLayer
    from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Model

    hf = make_tiny_hf("llama", seed=7, head_dim=32)
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, spec=spec, eos_token_ids=[2])
    eng.speculation.force(Arm("eagle3", 3, 1))
    catch_up, draft, pairs, chains = Eagle3Drafter._run_catch_up, Eagle3Drafter._draft, [], []
    chain, logits = FusedDraftLayer.chain, Eagle3Model.logits
    got_logits, ref_logits = [], []

    def chained(self, *a):
        out = chain(self, *a)
        got_logits.append(out[2])
        return out

    def eager_logits(self, out):
        ref_logits.append(logits(self, out))
        return ref_logits[-1]

    def both_catch_up(self, *a):
        layer = self.fused
        self.fused = None
        ref = catch_up(self, *a)
        self.fused = layer
        out = catch_up(self, *a)
        pairs.append((out, ref))
        return out

    def both_draft(self, seqs, h, depth, width):
        layer = self.fused
        with monkeypatch.context() as m:
            m.setattr(Eagle3Model, "logits", eager_logits)
            self.fused = None
            ref = draft(self, seqs, h, depth, width)
        self.fused = layer
        out = draft(self, seqs, h, depth, width)
        chains.append((out[0][:, 0], got_logits.pop(), ref[0][:, 0], torch.stack(ref_logits, 1)))
        ref_logits.clear()
        return out

    monkeypatch.setattr(FusedDraftLayer, "chain", chained)
    monkeypatch.setattr(Eagle3Drafter, "_run_catch_up", both_catch_up)
    monkeypatch.setattr(Eagle3Drafter, "_draft", both_draft)
    prompts = random_prompts(2, 6, 12, seed=7)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    got = [r.completion_ids for r in eng.generate(prompts, params)]
    # every proposal's chain through the op; a catch-up a proposal, and the early one after the last verify
    assert len(chains) >= 5 and len(chains) <= len(pairs) <= len(chains) + 1
    for out, ref in pairs:
        torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.05)
    compared = 0
    for ids, lg, ref_ids, ref_lg in chains:  # [R, depth] target ids, [R, depth, Vd] logits
        for r in range(len(ids)):
            agree = int((ids[r] == ref_ids[r]).long().cumprod(0).sum())
            upto = min(agree + 1, ids.shape[1])
            torch.testing.assert_close(lg[r, :upto], ref_lg[r, :upto], atol=0.05, rtol=0.05)
            compared += upto
    assert compared >= 2 * len(chains) * 2  # most draws of most chains
    plain_eng = RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, eos_token_ids=[2])
    assert got == [r.completion_ids for r in plain_eng.generate(prompts, params)]
    assert eng.runner.steps.counts["eager"] == 0 and eng.runner.steps.counts["fused"] > 0


@pytest.mark.skipif(not kernels.available(), reason="no AVX-512 BF16 CPU or no C++ toolchain")
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chain_op_draws_each_token_from_the_networks_law(temperature):
    """draft_chain's sampled chains have the drafter network's law. 20000 chains of two draws from one state (a
    cached context of 5 keys, the second draw's step writing the 6th): their (first, second) pairs against the exact
    joint law q0(a) q1(b | a), computed in float64 by the network itself (Eagle3Model.forward, attention written
    out here), chi-square at the suite's ALPHA. Each returned q is softmax(logits / T) of the logits returned beside
    it, and near the float64 law. A draft vocabulary of 6 ids that are not a prefix of the target's checks the id
    map; weights scaled up make q peaked and q1 depend on the first draw, so a second draw from q0, from another
    token's state or at another temperature fails (q1 moves by >= 0.1 between first draws)."""
    from tests.rollout.law_helpers import ALPHA, chi2_pvalue
    from rlspec.rollout.runtime.model.linear import fast_linear
    from rlspec.rollout.speculation.drafters.eagle3_fused import FusedDraftLayer
    from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model

    H, D, V, ctx = 64, 32, 16, 5
    cfg = Eagle3Config(H, 128, 2, 1, D, 1e-5, V, 6, (1, 1, 1))
    g = torch.Generator().manual_seed(3)
    model = Eagle3Model.initialised(cfg, g)
    with torch.no_grad():
        for lin, scale in ((model.lm_head, 3.0), (model.midlayer.self_attn.v_proj, 8.0),
                           (model.midlayer.mlp.down_proj, 8.0)):
            lin.weight.mul_(scale)
    model.set_draft_vocab(torch.tensor([1, 4, 5, 9, 12, 15]))
    model = model.to(torch.bfloat16).eval()
    embed = torch.randn(V, H, generator=g).to(torch.bfloat16)
    h0 = torch.randn(1, H, generator=g).to(torch.bfloat16)
    k_pool, v_pool = (torch.randn(1, 16, 1, D, generator=g).to(torch.bfloat16) for _ in range(2))
    theta = ctx / 10000 ** (torch.arange(0, D, 2) / D)
    cos, sin = (t.to(torch.bfloat16).view(1, 1, 1, 1, D) for t in (torch.cat([theta, theta]).cos(),
                                                                    torch.cat([-theta, theta]).sin()))  # signed
    mask = (torch.arange(16) <= ctx).view(1, 1, 1, 1, 16)
    ids = model.draft_vocab()
    layer = FusedDraftLayer(model).prepare()

    # the exact law, in float64 from the bf16 weights
    ref = Eagle3Model(cfg).double().eval()
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()})

    def attend(q, k, v):  # the context's keys and this step's own, every head over its KV head
        keys, vals = torch.cat([k_pool[0, :ctx, 0].double()[None, None], k], 2), torch.cat(
            [v_pool[0, :ctx, 0].double()[None, None], v], 2)
        return torch.softmax(q @ keys.transpose(-1, -2) * D ** -0.5, -1) @ vals

    def law_after(h):  # Eagle3Model.logits rounds to float32
        return torch.softmax(fast_linear(ref.lm_head, ref.norm(h)) / temperature, -1)

    with torch.no_grad():
        q0 = law_after(h0.double())[0]
        q1 = torch.stack([law_after(ref(h0.double()[None], embed[t].double().view(1, 1, H), cos[0].double(),
                                        sin[0].double(), attend))[0, 0] for t in ids])
    apart = (q1[:, None] - q1[None]).abs().sum(-1) + torch.eye(6)  # L1 between q1 after two first draws
    assert apart.min() >= 0.1 and q0.max() < 0.9  # the wrong variants differ from the law
    law = (q0[:, None] * q1).reshape(-1)

    N, t2d = 20_000, model.target_to_draft()
    pairs = torch.empty(N, dtype=torch.long)
    r = torch.rand(N, 2, 1, generator=g)
    for n in range(N):
        tok, q, logits, finite = layer.chain(h0, embed, cos, sin, k_pool, v_pool, torch.tensor([[ctx]]),
                                             torch.tensor([[0]]), mask, ids, r[n], temperature)
        pairs[n] = t2d[tok[0, 0]] * 6 + t2d[tok[0, 1]]
        if n < 50:
            assert finite.all() and (t2d[tok] >= 0).all()
            assert q.shape == (1, 2, V) and q[..., t2d < 0].abs().max() == 0  # over the target's vocabulary
            q = q[..., ids].double()
            torch.testing.assert_close(q, torch.softmax(logits.double() / temperature, -1), atol=1e-6, rtol=0)
            torch.testing.assert_close(q[0, 0], q0, atol=0.02, rtol=0)
            torch.testing.assert_close(q[0, 1], q1[t2d[tok[0, 0]]], atol=0.02, rtol=0)
    assert chi2_pvalue(torch.bincount(pairs, minlength=36), law) > ALPHA


def test_catch_up_over_skipped_steps_is_kept_out_of_the_selectors_drafting_cost(monkeypatch):
    """A drafter that sat out steps catches up on their positions at its next proposal (its backlog). The selector
    learns drafting's cost from the seconds without that backlog: drafting on every step never pays it. The first
    chain after plain steps has a backlog and the selector is told less than the proposal took; the chains after
    it, each catching up on the previous step's commit only, have none. Each chain's step also runs the next
    proposal's catch-up before its read (eagle3_catch_up.py): the selector is told those seconds as drafting."""
    from rlspec.rollout.speculation.selectors.base import OFF
    from rlspec.rollout.speculation.speculation import Speculation

    hf = make_tiny_hf("llama", seed=5)
    eng = eagle_engine(hf, k=3, force=False)
    eng.speculation.learned.early = True  # as on CUDA
    arms = iter([OFF] * 6 + [Arm("eagle3", 3, 1)] * 100)
    monkeypatch.setattr(Speculation, "choose", lambda self, batch: next(arms))
    seen, told = [], []
    observe_step, observe = Speculation.observe_step, eng.speculation.selector.observe

    def spy_step(self, arm, batch, seconds, draft_seconds, *rest):
        early = self.learned.early_span
        seen.append((arm, draft_seconds, self.learned.backlog_seconds, early.seconds() if early else 0.0))
        return observe_step(self, arm, batch, seconds, draft_seconds, *rest)

    monkeypatch.setattr(Speculation, "observe_step", spy_step)
    monkeypatch.setattr(eng.speculation.selector, "observe",
                        lambda arm, batch, seconds, draft_seconds, *rest: (told.append(draft_seconds),
                                                                           observe(arm, batch, seconds, draft_seconds,
                                                                                   *rest)))
    params = SamplingParams(temperature=1.0, max_new_tokens=14, ignore_eos=True, seed=0)
    eng.generate(random_prompts(1, 5, 8, seed=5), params)
    chains = [(i, d, b, e) for i, (arm, d, b, e) in enumerate(seen) if arm.speculative]
    assert len(chains) >= 3 and chains[0][0] == 6 and all(e > 0 for *_, e in chains)
    first, later = chains[0], chains[1:]
    assert 0 < first[2] < first[1] and told[first[0]] == pytest.approx(first[1] - first[2] + first[3])
    assert all(b == 0.0 and told[i] == pytest.approx(d + e) for i, d, b, e in later)


def test_a_catch_up_still_running_is_counted_once_it_ran(monkeypatch):
    """On CUDA the next proposal's catch-up may still run when the step's transfer is read: its seconds move from
    the verify to drafting at a later step of the drafter, once it ran, and are never read before (a CUDA event's
    elapsed time raises then)."""
    eng = eagle_engine(make_tiny_hf("llama", seed=5), k=3, force=False)
    spec = eng.speculation
    told = []
    monkeypatch.setattr(spec.selector, "observe", lambda arm, batch, s, d, *rest: told.append((s, d)))

    class Running:
        ran = False

        def done(self):
            return self.ran

        def seconds(self):
            assert self.ran, "read before its work ran"
            return 0.25

    span, arm = Running(), Arm("eagle3", 3, 1)
    spec.learned.early_span = span
    spec.observe_step(arm, 1, 1.0, 0.5, [3], [1])
    span.ran = True
    spec.observe_step(arm, 1, 1.0, 0.5, [3], [1])
    spec.observe_step(arm, 1, 1.0, 0.5, [3], [1])
    backlog = spec.learned.backlog_seconds
    assert told == [(1.0, 0.5 - backlog), (0.75, 0.75 - backlog), (1.0, 0.5 - backlog)]


class _Banked:
    """Stands in for the drafter's trainer: keeps what finished samples bank (features, tokens, the target's law)."""
    topk = 4

    def __init__(self):
        self.samples = []

    def add(self, feats, ids, version, dist, temperature):
        self.samples.append((feats.clone(), list(ids), dist))

    def latest(self):
        return None


def planting(ref: list[list[int]], rng, vocab: int, planted: Counter | None = None):
    """A stand-in for Eagle3Drafter._draft: the drafter's draws, each token moved one id on (junk), then each row's
    true continuation (its prompt's in `ref`) planted on a random branch up to a random depth; planted counts where."""
    draft = Eagle3Drafter._draft

    def plant(self, seqs, h, depth, width):
        ids, q, kept = draft(self, seqs, h, depth, width)
        ids = (ids + 1) % vocab
        for i, s in enumerate(seqs):
            truth = ref[s.prompt_index][len(s.completion_ids):][:ids.shape[2]]
            b, n = rng.randrange(ids.shape[1]), rng.randrange(len(truth) + 1)
            ids[i, b, :n] = torch.tensor(truth[:n])
            if planted is not None:
                planted["off the first branch" if b and n else "first branch" if n else "none"] += 1
        return ids, q, kept

    return plant


def path_moves(monkeypatch) -> Counter:
    """Counts, under "path", the tree paths whose KV the commit moves into place (PagedKVCache.gather_positions)."""
    moved, gather = Counter(), PagedKVCache.gather_positions
    monkeypatch.setattr(PagedKVCache, "gather_positions", lambda *a: (moved.update(["path"]), gather(*a)))
    return moved


@pytest.mark.parametrize("width", [1, 2], ids=["chains", "trees"])
def test_paths_bank_the_features_and_law_of_the_tokens_kept(monkeypatch, width):
    """The features and the target's law staged at a step's kept nodes, before the host reads the step (the verifier's
    counts on the device mask the rest), are those of the tokens kept: with drafts planted so that chains accept
    parts of themselves and trees paths off their first branch (the KV of the path moved into place), every banked
    position equals a fresh forward over the sample. (A chain's node j is its position j: staged as it is.)"""
    import random

    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(4, 3, 12, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ref = plain(hf, prompts, params)
    eng = eagle_engine(hf, width=width, k=4)
    drafter = eng.speculation.learned
    rec = _Banked()
    drafter.attach(rec)
    planted = Counter()
    monkeypatch.setattr(Eagle3Drafter, "_draft", planting(ref, random.Random(0), hf.config.vocab_size, planted))
    moved = path_moves(monkeypatch)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    if width > 1:
        assert moved["path"] >= 5 and min(planted.values()) >= 5, (moved, planted)
    else:
        assert planted["first branch"] >= 5 and planted["none"] >= 2, planted
    assert len(rec.samples) == len(prompts)
    for feats, ids, dist in rec.samples:
        with torch.no_grad():
            out = hf(torch.tensor([ids[:len(feats)]]), output_hidden_states=True)
        torch.testing.assert_close(feats, torch.cat([out.hidden_states[i][0] for i in drafter.aux_layers], -1),
                                   atol=1e-4, rtol=1e-4)
        law = torch.softmax(out.logits[0].float(), -1)  # a greedy call's law: the softmax at temperature 1
        generated = torch.nonzero(dist.has).flatten()
        assert len(generated) >= len(feats) - 12  # every position after the prompt's
        top = law[generated].topk(4, -1)
        assert torch.equal(dist.ids[generated].long(), top.indices)
        torch.testing.assert_close(dist.probs[generated].float(), top.values, atol=2e-3, rtol=1e-2)


@pytest.mark.parametrize("width,graphs", [(1, "off"), (2, "off"), (1, "emulate"), (2, "emulate")])
def test_early_catch_up_gives_the_proposals_own(width, graphs, monkeypatch):
    """The catch-up run before the host reads a verify of the drafter's own drafts (eagle3_catch_up.py) gives the
    next proposal what its own catch-up would: greedy rollouts with drafts planted so that trees accept paths off
    their first branch (whose KV the commit moves after the early run wrote the drafter's), rows admitted beside
    rows still going (a proposal of early and caught-up rows) and plain steps between proposals (an early run no
    proposal takes), eagerly and through the drafter's (emulated) graphs. Every proposal's catch-up outputs equal
    those of the same rollout with no early run, to rounding."""
    import random

    from rlspec.rollout.speculation.selectors.base import OFF
    from rlspec.rollout.speculation.speculation import Speculation

    hf = make_tiny_hf("llama", seed=8)
    prompts = random_prompts(8, 3, 12, seed=8)
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    ref = plain(hf, prompts, params)
    weights = None

    def rollout(early: bool):
        nonlocal weights
        eng = eagle_engine(hf, width=width, k=4, force=False, max_num_seqs=3)
        drafter = eng.speculation.learned
        drafter.graph_mode, drafter.early = graphs, early  # early: on CUDA by default
        if weights is None:
            with torch.no_grad():
                drafter.model.lm_head.weight.mul_(8.0)  # drafts that differ between rows and positions
            weights = drafter.model.state_dict()
        drafter.model.load_state_dict(weights)
        steps, rng, kinds, outputs = [], random.Random(0), Counter(), []
        arm = Arm("eagle3", 4, width)  # three proposals, then a plain step
        monkeypatch.setattr(Speculation, "choose", lambda self, b: steps.append(b) or (arm if len(steps) % 4 else OFF))
        catch_up, moved = Eagle3Drafter._catch_up, path_moves(monkeypatch)

        def noted(self, seqs):
            ran = self._early[0] if self._early else {}
            mine = sum(s.cache_len == self.valid[id(s)] and id(s) in ran for s in seqs)
            kinds["early" if mine == len(seqs) else "mixed" if mine else "caught up"] += 1
            out = catch_up(self, seqs)
            outputs.append(out[0].clone())
            return out

        monkeypatch.setattr(Eagle3Drafter, "_draft", planting(ref, rng, hf.config.vocab_size))
        monkeypatch.setattr(Eagle3Drafter, "_catch_up", noted)
        assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
        monkeypatch.undo()
        return outputs, kinds, moved

    want, _, _ = rollout(False)
    got, kinds, moved = rollout(True)
    assert len(got) == len(want) >= 20, (len(got), kinds)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert kinds["early"] >= 5 and kinds["mixed"] >= 1 and kinds["caught up"] >= 3, kinds
    assert width == 1 or moved["path"] >= 3
