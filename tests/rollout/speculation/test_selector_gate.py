"""The learned drafter's gate (selectors/gate.py): an untrained learned drafter is no arm of `auto`; its
trainer's acceptance estimate admits it when the estimate pays somewhere; measured acceptance takes
over once it plays and closes the gate again when it falls. Synthetic world of test_selector.py for
the selectors, tiny random models for the engine and the trainer's estimate."""
from __future__ import annotations

import random

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.registry import SELECTORS
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.ledger import Ledger
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.speculation.selectors.gate import GATE_TRIALS, LearnedGate
from rlspec.rollout.speculation.selectors.fixed import FixedSelector
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_selector import DRAFTERS, World, calibrated, run

SMALL = [1, 2, 3]  # buckets 1, 2, 4: where verification is cheap and a good drafter pays


def gated(world: World, drafter_path: str | None = None):
    """The engine's adaptive selector for `auto` (registry builder: eagle3 gated), with world costs."""
    spec = SpecConfig(drafter="auto", selector="adaptive", num_draft_tokens=8, drafter_path=drafter_path)
    sel = SELECTORS.build("adaptive", spec, list(DRAFTERS), ("eagle3",))
    sel.costs = calibrated(world, sel.arms)
    return sel


def eagle3_share(picks: dict) -> float:
    arms = [a for chosen in picks.values() for a in chosen]
    return sum(a.drafter == "eagle3" for a in arms) / len(arms)


def test_an_untrained_learned_drafter_is_never_an_arm():
    """Even one that would pay (true acceptance 0.8): without evidence it is not tried at all. Without
    the gate the bandit's a = 0.5 prior had it explored and played from the first steps."""
    world = World(accept={"suffix": 0.3, "ngram": 0.2, "eagle3": 0.8})
    sel = gated(world)
    picks = run(world, sel, 1500, random.Random(0), batches=SMALL + [12])
    assert eagle3_share(picks) == 0.0
    assert sel.metrics()["strategy/gate/eagle3"] == 0.0
    assert all(a.drafter != "eagle3" for a in sel._playable)


def test_the_trainers_estimate_admits_it_and_measurements_close_the_gate_again():
    world = World(accept={"suffix": 0.3, "ngram": 0.2, "eagle3": 0.8})
    sel, rng = gated(world), random.Random(1)
    run(world, sel, 300, rng, batches=SMALL)
    sel.admit("eagle3", 0.75)  # what the trainer estimated for its published weights
    assert sel.acceptance["eagle3"].rate == pytest.approx(0.75)  # the estimate is the tracker's prior
    picks = run(world, sel, 800, rng, batches=SMALL)
    assert sel.gates["eagle3"].open and eagle3_share(picks) > 0.5  # it pays: the bandit plays it
    assert sel.gates["eagle3"].measured >= GATE_TRIALS
    world.accept["eagle3"] = 0.02  # the policy moved away from it: measured acceptance falls
    run(world, sel, 400, rng, batches=SMALL)
    assert not sel.gates["eagle3"].open
    late = run(world, sel, 400, rng, batches=SMALL)
    assert eagle3_share(late) == 0.0


def test_an_estimate_that_cannot_pay_keeps_the_gate_shut():
    world = World(accept={"suffix": 0.3, "ngram": 0.2, "eagle3": 0.8})
    sel = gated(world)
    sel.admit("eagle3", 0.01)
    picks = run(world, sel, 600, random.Random(2), batches=SMALL)
    assert eagle3_share(picks) == 0.0 and not sel.gates["eagle3"].open


def test_trained_weights_from_a_directory_are_trusted_as_before():
    world = World(accept={"suffix": 0.3, "ngram": 0.2, "eagle3": 0.8})
    sel = gated(world, drafter_path="some/trained/dir")
    picks = run(world, sel, 800, random.Random(3), batches=SMALL)
    assert eagle3_share(picks) > 0.3


def test_the_fixed_selector_gates_a_learned_drafter_too():
    world = World(accept={"suffix": 0.3, "ngram": 0.2, "eagle3": 0.8})
    sel = SELECTORS.build("fixed", SpecConfig(drafter="eagle3", num_draft_tokens=4), ["eagle3"], ("eagle3",))
    assert isinstance(sel, FixedSelector) and sel.gate is not None
    sel.costs = calibrated(world, [Arm("eagle3", d) for d in sel.depths()])
    rng = random.Random(4)
    assert {world.step(sel, 2, rng) for _ in range(200)} == {Arm("none")}
    sel.admit("eagle3", 0.8)
    assert sum(world.step(sel, 2, rng).speculative for _ in range(200)) > 150
    world.accept["eagle3"] = 0.0
    for i in range(400):  # at live batches 1 and 2, where a one-level draft was closest to paying
        world.step(sel, 1 + i % 2, rng)
    assert sel.gate.measured >= GATE_TRIALS  # measurements decide
    assert not sel.gate.open and not world.step(sel, 2, rng).speculative and not world.step(sel, 1, rng).speculative


def test_gate_counts_the_ledgers_trials_and_its_state_round_trips():
    """The gate's measured trials are the ledger's count of the drafter's since the latest estimate, not a count
    of its own."""
    ledger = Ledger()
    gate = LearnedGate(trusted=False).bind(ledger, "eagle3")
    ledger.record(Arm("eagle3", 4), 1, 0.01, 0.001, [4], [4])  # before the estimate: not counted
    gate.admit(0.4)
    ledger.record(Arm("eagle3", 4), 1, 0.01, 0.001, [4], [2])  # 2 accepted, then a rejection: 3 trials
    assert gate.measured == 3.0 and ledger.trials["eagle3"] == 7.0
    again = Ledger()
    again.load_state_dict(ledger.state_dict())
    back = LearnedGate().bind(again, "eagle3")
    back.load_state_dict(gate.state_dict())
    assert back == gate and back.measured == 3.0


# ---- the engine ---------------------------------------------------------------------------------------
def auto_engine(hf) -> RolloutEngine:
    spec = SpecConfig(drafter="auto", num_draft_tokens=4, online_training=False)
    return RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=16)


def recorded_arms(eng) -> list[Arm]:
    """Every arm the engine's selector chooses from now on."""
    sel, arms = eng.speculation.selector, []
    choose = sel.choose

    def spy(batch: int) -> Arm:
        arms.append(choose(batch))
        return arms[-1]

    sel.choose = spy
    return arms


def test_auto_with_an_untrained_eagle3_never_drafts_with_it():
    eng = auto_engine(make_tiny_hf("llama", seed=21))
    arms = recorded_arms(eng)
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=48, seed=0)
    eng.generate(random_prompts(4, 4, 10, seed=21), params)
    eng.generate(random_prompts(4, 4, 10, seed=22), params)
    assert arms and all(a.drafter != "eagle3" for a in arms)
    stats = eng.stats()
    assert stats["strategy/gate/eagle3"] == 0.0
    assert "rollout/accept_len/eagle3" not in stats or stats["rollout/accept_len/eagle3"] == 1.0


def test_the_trainers_estimate_reaches_the_gate_and_tracks_training():
    """DrafterTrainer.acceptance_estimate (1 - TV on buffered rollouts, no verify spent) is handed to the
    selector at the next call; an untrained drafter's is low and training raises it."""
    from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer

    eng = auto_engine(make_tiny_hf("llama", seed=23))
    spec = eng.speculation
    trainer = spec.attach_trainer(DrafterTrainer(spec.learned, lr=3e-3, batch=8, window=32, min_tokens=64,
                                                 publish_every=10**9))
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=40, seed=0, ignore_eos=True)
    assert trainer.acceptance_estimate() is None
    eng.generate(random_prompts(4, 4, 10, seed=23), params)  # banks samples with the target's top-k
    trainer.publish()
    version, cold = trainer.acceptance_estimate()
    assert version == 1 and 0.0 <= cold < 0.5
    trainer.train_steps(120)
    trainer.publish()
    version, warm = trainer.acceptance_estimate()
    assert version == 2 and warm > cold + 0.1, (cold, warm)
    assert trainer.metrics(0)["drafter/est_accept"] == pytest.approx(warm)
    eng.generate(random_prompts(2, 4, 10, seed=24), params)
    assert spec.selector.gates["eagle3"].estimate == pytest.approx(warm)
    spec.detach_trainer()


def test_the_process_trainer_passes_the_estimate_through_its_metrics_snapshot():
    from rlspec.rollout.speculation.training.trainer_process import ProcessTrainer

    proxy = object.__new__(ProcessTrainer)  # only the snapshot reader is exercised: no child process
    proxy._snapshot = lambda: {"drafter/est_accept_version": 0.0, "drafter/est_accept": float("nan")}
    assert proxy.acceptance_estimate() is None  # nothing published yet
    proxy._snapshot = lambda: {"drafter/est_accept_version": 3.0, "drafter/est_accept": 0.42}
    assert proxy.acceptance_estimate() == (3, 0.42)
    proxy._snapshot = lambda: {"drafter/est_accept_version": 4.0, "drafter/est_accept": float("nan")}
    assert proxy.acceptance_estimate() == (4, None)  # published weights it could not judge (loaded ones)
