"""Speculation state in checkpoints: a fresh engine that loads engine.state_dict() (through torch.save and
torch.load(weights_only=True)) generates token for token what the saved engine generates next, for the
suffix, n-gram and EAGLE-3 drafters under the bandit; the online trainer's weights, optimizer, buffer and
generator round-trip (thread and process) and training goes on identically; a state of another
configuration is refused with a message naming the difference; building an EAGLE-3 engine leaves the
global RNG alone."""
from __future__ import annotations

import random
import time
import types

import pytest
import torch

import rlspec.rollout.decode
import rlspec.rollout.engine
import rlspec.rollout.runtime.device
import rlspec.rollout.speculation.training.drafter_training
import rlspec.rollout.speculation.drafters.eagle3
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.sequence import Sequence
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from rlspec.rollout.speculation.drafters.suffix import SuffixDrafter
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts


@pytest.fixture
def clock(monkeypatch):
    """A deterministic clock for the engine, the cost model's timer (runtime/device.py), the drafter trainer and the learned drafter (its
    catch-up backlog's seconds): the adaptive selector decides on measured seconds, so two engines only choose alike
    when their clocks agree. Ticks of 2^-10 s keep every difference exact in binary floating point, whatever the
    absolute time."""
    ticks = iter(range(1, 1 << 40))
    fake = types.SimpleNamespace(perf_counter=lambda: next(ticks) * 2.0 ** -10, sleep=time.sleep)
    for module in (rlspec.rollout.engine, rlspec.rollout.decode, rlspec.rollout.runtime.device,
                   rlspec.rollout.speculation.training.drafter_training, rlspec.rollout.speculation.drafters.eagle3):
        monkeypatch.setattr(module, "time", fake)


def engine(hf, **spec) -> RolloutEngine:
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=SpecConfig(**spec), eos_token_ids=[2], max_num_seqs=8)
    guard = getattr(eng.speculation.selector, "guard", None)
    if guard is not None:  # no loss floor: on this random model it would hold most arms, so little of the saved
        guard.alpha = float("inf")  # state would steer the choices (its own figures still round-trip)
    return eng


def through_disk(state: dict, tmp_path) -> dict:
    torch.save(state, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=True)


def same(a, b, path="state") -> None:
    """Assert two states are equal: tensors bit for bit, containers element by element."""
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)  # nan == nan here


def tokens(eng, prompts, seed) -> list[list[int]]:
    params = SamplingParams(temperature=0.3, n=3, max_new_tokens=24, seed=seed)
    return [r.completion_ids for r in eng.generate(prompts, params)]


def perturb_drafter(eng) -> None:
    """Stand in for trained weights: move the drafter away from its seeded initialisation."""
    d = eng.speculation.learned
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in d.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    d.version += 1


@pytest.mark.parametrize("drafter,selector", [("suffix", "adaptive"), ("suffix", "always"), ("ngram", "adaptive"),
                                             ("eagle3", "adaptive")])
def test_a_fresh_engine_resumes_token_for_token(drafter, selector, clock, tmp_path):
    hf = make_tiny_hf("llama", seed=3)
    prompts = random_prompts(3, 4, 10, seed=3)
    spec = dict(drafter=drafter, selector=selector, num_draft_tokens=4, online_training=False)
    a = engine(hf, **spec)
    if drafter == "eagle3":
        perturb_drafter(a)
    for seed in (0, 1):  # the same prompts again: the suffix drafter's history of them matters
        tokens(a, prompts, seed)
    state = through_disk(a.state_dict(), tmp_path)
    b, cold = engine(hf, **spec), engine(hf, **spec)
    if drafter == "eagle3":  # the same weights, only the saved state missing (an untrained drafter is no arm)
        perturb_drafter(cold)
    b.load_state_dict(state)
    same(b.state_dict(), a.state_dict())
    went = {}
    for seed in (2, 3):
        went[seed] = tokens(a, prompts, seed)
        assert tokens(b, prompts, seed) == went[seed]
    same(b.state_dict(), a.state_dict())  # and they went on alike
    # what was loaded mattered: an engine without it samples other tokens (temperature > 0: which arms
    # run and what they draft decide which uniforms each token uses)
    assert [tokens(cold, prompts, seed) for seed in (2, 3)] != [went[2], went[3]]


def test_suffix_history_round_trips_exactly(tmp_path):
    """Drafts after a restore equal the saved drafter's, with a global window small enough that samples
    were evicted from it (its index is rebuilt from the samples it still holds)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 12) for _ in range(6)] for _ in range(5)]

    def run(d, rounds, seed):
        r = random.Random(seed)
        drafts = []
        for _ in range(rounds):
            group = [Sequence(0, j, p, 40) for p in r.sample(prompts, 2) for j in range(2)]
            d.begin([group[:2], group[2:]])
            for _ in range(12):
                for s in group:
                    s.completion_ids.append(r.randrange(3, 12))
                drafts += [(dr.tokens, dr.parents) for dr in d.propose(group, [6] * len(group), 2)]
            for s in group:
                s.finish_reason = "length"
                d.finish(s)
        return drafts

    kw = dict(global_docs=5, history_per_prompt=3, max_prompts=4)
    a = SuffixDrafter(**kw)
    run(a, 6, seed=1)
    assert a.sizes()["global_docs"] == 5 and a.sizes()["prompts"] == 4  # evictions happened
    b = SuffixDrafter(**kw)
    b.load_state_dict(through_disk(a.state_dict(), tmp_path))
    assert b.sizes() == a.sizes()
    after_a, after_b = run(a, 4, seed=2), run(b, 4, seed=2)
    assert after_a == after_b and any(t for t, _ in after_a)
    assert run(SuffixDrafter(**kw), 4, seed=2) != after_a  # the history is what made them


def thread_trained_engine(hf):
    eng = engine(hf, drafter="eagle3", selector="always", num_draft_tokens=3, online_training=True,
                 online_trainer="thread")
    trainer = eng.speculation.trainer
    trainer.stop()  # no background steps: this test drives training itself, so that runs are deterministic
    trainer.min_tokens, trainer.publish_every = 16, 2
    return eng, trainer


def test_thread_trainer_weights_optimizer_and_buffer_round_trip(clock, tmp_path):
    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(4, 4, 10, seed=4)
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=20, seed=0)
    a, ta = thread_trained_engine(hf)
    a.generate(prompts, params)
    ta.train_steps(3)  # publishes version 1; step 3 is not published yet
    a.generate(prompts, params)  # the drafter swaps version 1 in
    assert a.speculation.learned.version == 1 and ta.stats.steps == 3 and ta.buffer.tokens > 0
    state = through_disk(a.state_dict(), tmp_path)
    b, tb = thread_trained_engine(hf)
    b.load_state_dict(state)
    same(b.state_dict(), a.state_dict())
    for k, v in a.speculation.learned.model.state_dict().items():
        assert torch.equal(v, b.speculation.learned.model.state_dict()[k]), k
    same(tb.opt.state_dict(), ta.opt.state_dict())
    assert ta.opt.state_dict()["state"]  # Adam moments were there to restore
    # training goes on identically (same windows drawn, same moments), and so does generation
    assert ta.train_steps(3) == tb.train_steps(3)
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=20, seed=1)
    assert [r.completion_ids for r in a.generate(prompts, params)] == \
        [r.completion_ids for r in b.generate(prompts, params)]
    assert b.speculation.learned.version == a.speculation.learned.version == 3
    same(b.state_dict(), a.state_dict())


def test_a_state_taken_while_the_thread_trains_is_consistent():
    """state_dict() takes the training lock: never half a step (optimizer moved, counters not yet)."""
    hf = make_tiny_hf("llama", seed=4)
    eng = engine(hf, drafter="eagle3", selector="always", num_draft_tokens=3, online_training=True,
                 online_trainer="thread")
    trainer = eng.speculation.trainer
    trainer.min_tokens = 16
    try:
        eng.generate(random_prompts(4, 4, 10, seed=4), SamplingParams(temperature=0.8, n=2, max_new_tokens=20))
        eng.speculation.set_idle(True)  # the background thread trains from here on
        deadline = time.monotonic() + 60
        while trainer.stats.steps < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = set()
        for _ in range(40):  # back to back: without the lock a step lands inside a snapshot within a few
            st = eng.state_dict()["speculation"]["trainer"]
            steps = {float(p["step"]) for p in st["optimizer"]["state"].values()}
            assert steps == {float(st["stats"]["steps"])}, (steps, st["stats"])
            seen.add(st["stats"]["steps"])
        assert trainer.stats.error is None and len(seen) > 1  # it did train between snapshots
    finally:
        eng.close()


def test_process_trainer_state_round_trips_through_the_child(tmp_path):
    from rlspec.rollout.speculation.training.trainer_process import ProcessTrainer

    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(4, 4, 10, seed=4)
    spec = dict(drafter="eagle3", selector="always", num_draft_tokens=3, online_training=False)

    def with_process_trainer():
        eng = engine(hf, **spec)
        eng.speculation.attach_trainer(ProcessTrainer(eng.speculation.learned, threads=1, min_tokens=16,
                                                      publish_every=2))
        return eng

    a = with_process_trainer()
    try:
        a.generate(prompts, SamplingParams(temperature=0.8, n=2, max_new_tokens=20, seed=0))
        a.speculation.set_idle(False)  # no more background steps: the state below is what it stays
        a.speculation.trainer.train_steps(3)
        saved = a.state_dict()
        assert saved["speculation"]["trainer"]["stats"]["steps"] >= 3 and saved["speculation"]["trainer"]["published"]
        b = with_process_trainer()
        try:
            b.load_state_dict(through_disk(saved, tmp_path))
            same(b.state_dict(), saved)
            assert b.speculation.trainer.train_steps(2) == a.speculation.trainer.train_steps(2)
            for k, v in a.speculation.trainer.model.state_dict().items():  # what export_drafter writes
                assert torch.equal(v, b.speculation.trainer.model.state_dict()[k]), k
        finally:
            b.close()
    finally:
        a.close()
    # a child that is gone has no state to give: the drafter's weights still resume, without training
    dead = through_disk(a.state_dict(), tmp_path)
    assert dead["speculation"]["trains"] and dead["speculation"]["trainer"] is None
    c = engine(hf, **spec)
    c.load_state_dict(dead)
    for k, v in a.speculation.learned.model.state_dict().items():
        assert torch.equal(v, c.speculation.learned.model.state_dict()[k]), k
    with pytest.raises(ValueError, match="trainer had died.*online_training=False"):
        thread_trained_engine(hf)[0].load_state_dict(dead)


def test_process_trainer_state_loads_into_a_thread_trainer(tmp_path):
    """A run may resume on other hardware, where online_trainer="auto" picks a thread: same state."""
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer

    hf = make_tiny_hf("llama", seed=4)
    a, ta = thread_trained_engine(hf)
    a.generate(random_prompts(4, 4, 10, seed=4), SamplingParams(temperature=0.8, n=2, max_new_tokens=20, seed=0))
    ta.train_steps(2)
    state = a.state_dict()
    state["speculation"]["trainer"]["dropped"] = 0  # what a process trainer adds
    b, tb = thread_trained_engine(hf)
    b.load_state_dict(state)
    assert isinstance(tb, DrafterTrainer) and tb.stats.steps == 2 and tb.version == ta.version == 1


@pytest.mark.parametrize("saved,here,needle", [
    (dict(drafter="suffix", selector="adaptive"), dict(drafter="ngram", selector="adaptive"), "drafters"),
    (dict(drafter="suffix", selector="adaptive"), dict(drafter="suffix", selector="fixed"), "selector"),
    (dict(drafter="suffix", selector="fixed"), dict(drafter="suffix", selector="fixed", num_draft_tokens=6),
     "fixed selector arms"),
    (dict(drafter="eagle3", draft_vocab_size=32), dict(drafter="eagle3", draft_vocab_size=48), "eagle3 drafter shape"),
])
def test_a_state_of_another_configuration_is_refused(saved, here, needle):
    hf = make_tiny_hf("llama", seed=2)
    a = engine(hf, online_training=False, **saved)
    a.generate(random_prompts(2, 4, 8, seed=2), SamplingParams(temperature=0, max_new_tokens=6))
    b = engine(hf, online_training=False, **here)
    before = b.state_dict()
    with pytest.raises(ValueError, match=needle) as err:
        b.load_state_dict(a.state_dict())
    assert "SpecConfig" in str(err.value)
    same(b.state_dict()["speculation"], before["speculation"])  # nothing was changed


def test_a_state_with_online_training_needs_a_trainer():
    hf = make_tiny_hf("llama", seed=2)
    a, _ = thread_trained_engine(hf)
    b = engine(hf, drafter="eagle3", selector="always", num_draft_tokens=3, online_training=False)
    with pytest.raises(ValueError, match="online drafter training.*online_training"):
        b.load_state_dict(a.state_dict())


def test_building_an_eagle3_engine_leaves_the_global_rng_alone():
    hf = make_tiny_hf("llama", seed=1)
    model = loader.from_hf_model(hf)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    eng = RolloutEngine(model, None, spec=SpecConfig(drafter="eagle3", online_training=True, online_trainer="thread"),
                        eos_token_ids=[2])
    eng.close()
    assert torch.equal(torch.get_rng_state(), before)
    # ... and the drafter still starts from the weights the seed always gave
    c = Eagle3Config.for_target(model.cfg, 4096)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        reference = Eagle3Model(c)
    for k, v in reference.state_dict().items():
        assert torch.equal(v, eng.speculation.learned.model.state_dict()[k].float()), k
