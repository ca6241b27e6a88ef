"""The drafter trainer in a process of its own: it trains (idle and on request), publishes weights the
engine swaps in without changing a greedy token, reports a crash or a killed child while the engine
keeps its last drafter, and leaves no process behind."""
from __future__ import annotations

import math
import os
import signal
import time

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
from rlspec.rollout.speculation.training.trainer_process import ProcessTrainer
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_eagle3 import eagle_engine, plain


class ExplodingTrainer(DrafterTrainer):
    """Built in the child by name: fails at its first training step."""

    def train_steps(self, n: int) -> float:
        raise RuntimeError("boom")


def wait_for(cond, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_trains_idle_and_on_request_publishes_and_stays_exact(tmp_path):
    hf = make_tiny_hf("llama", seed=9)
    prompts = random_prompts(8, 4, 10, seed=9)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    ref = plain(hf, prompts, params)
    eng = eagle_engine(hf, k=4)
    trainer = eng.speculation.attach_trainer(ProcessTrainer(eng.speculation.learned, threads=1, lr=3e-3, batch=8,
                                                            window=32, min_tokens=64, publish_every=20))
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    cold = eng.stats()["rollout/accept_len"]
    # generate() ended by declaring compute idle: the child trains on its own and publishes
    assert wait_for(lambda: trainer.stats.steps >= 20 and trainer.latest() is not None), trainer.metrics(0)
    trainer.set_idle(False)
    trainer.train_steps(120)  # and on request, synchronously
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref  # swapped weights, still exact
    stats = eng.stats()
    assert eng.speculation.learned.version == trainer.version >= 2
    assert stats["drafter/version"] >= 2 and stats["drafter/train_steps"] >= 140 and stats["drafter/failed"] == 0
    assert stats["rollout/accept_len"] > cold + 0.5, (cold, stats["rollout/accept_len"])
    # the engine staged the target's top-k law for the child, as for a trainer in this process
    assert trainer.topk == 32 and bool(trainer.state_dict()["buffer"]["dist"]["has"].any())
    pid = trainer.pid
    eng.close()
    assert wait_for(lambda: gone(pid), 10) and trainer._proc.exitcode == 0
    # the final master weights were published on stop and are what gets exported
    eng.export_drafter(str(tmp_path / "d"))
    assert (tmp_path / "d" / "model.safetensors").is_file()
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref  # usable after close


def test_crash_in_the_child_is_reported_and_the_engine_keeps_working():
    hf = make_tiny_hf("llama", seed=10)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(ProcessTrainer(
        eng.speculation.learned, factory=f"{__name__}:ExplodingTrainer", min_tokens=1))
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    prompts = random_prompts(2, 4, 6)
    ref = plain(hf, prompts, params)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref  # ends idle: the child steps, fails
    assert wait_for(lambda: eng.stats()["drafter/failed"] == 1.0)
    assert "boom" in trainer.stats.error
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    assert eng.speculation.learned.version == 0  # nothing was published: the cold drafter stays
    eng.close()


def test_a_killed_child_is_reported_and_the_last_drafter_kept():
    hf = make_tiny_hf("llama", seed=11)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(ProcessTrainer(eng.speculation.learned, min_tokens=16, publish_every=1))
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompts = random_prompts(3, 4, 8, seed=11)
    ref = plain(hf, prompts, params)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    trainer.train_steps(3)
    eng.generate(prompts[:1], params)  # swaps the published weights in
    version = eng.speculation.learned.version
    assert version >= 1
    os.kill(trainer.pid, signal.SIGKILL)
    assert wait_for(lambda: eng.stats()["drafter/failed"] == 1.0, 10)
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    # the child trains while the engine idles, so it may have published once more before it died:
    # the engine keeps the newest weights it published, and nothing changes them after its death
    kept = eng.speculation.learned.version
    assert kept >= version and kept == trainer.version
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    assert eng.speculation.learned.version == kept and math.isnan(trainer.train_steps(1))
    eng.close()


@pytest.mark.parametrize("mode,kind", [("auto", ProcessTrainer), ("thread", DrafterTrainer), ("process", ProcessTrainer)])
def test_spec_config_chooses_where_training_runs(mode, kind):  # on the CPU "auto" means a process
    hf = make_tiny_hf("llama", seed=12)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2],
                        spec=SpecConfig(drafter="eagle3", online_training=True, online_trainer=mode, trainer_threads=1))
    trainer = eng.speculation.trainer
    assert isinstance(trainer, kind)
    eng.close()
    with pytest.raises(ValueError, match="online_trainer"):
        SpecConfig(drafter="eagle3", online_trainer="gpu")
    with pytest.raises(ValueError, match="trainer_threads"):
        SpecConfig(drafter="eagle3", trainer_threads=0)


def test_online_training_auto_is_off_on_a_cpu_target():
    """A CPU has no idle cores for the trainer (decoding and the policy update use them all): "auto"
    keeps the drafter as loaded or warm-started; true still trains there, and a typo is refused."""
    hf = make_tiny_hf("llama", seed=13)
    eng = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], spec=SpecConfig(drafter="eagle3"))
    assert eng.spec.online_training == "auto" and eng.speculation.trainer is None
    eng.close()
    with pytest.raises(ValueError, match="online_training must be 'auto', true or false"):
        SpecConfig(drafter="eagle3", online_training="yes")


def test_sigterm_to_the_group_leaves_the_child_to_the_parent_and_a_stuck_child_times_out(monkeypatch):
    """Slurm signals the whole job: the child ignores SIGTERM (as SIGINT), so the parent still gets its state
    for the checkpoint; a child alive but stopped answers no request, which fails with a clear error in time
    (and state_dict, the checkpoint's call, gives None with a warning rather than hanging)."""
    from rlspec.rollout.speculation.training.trainer_process import DrafterTrainerTimeout

    hf = make_tiny_hf("llama", seed=11)
    eng = eagle_engine(hf)
    trainer = eng.speculation.attach_trainer(ProcessTrainer(eng.speculation.learned, min_tokens=16, publish_every=1))
    try:
        eng.generate(random_prompts(2, 4, 8, seed=11), SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
        os.kill(trainer.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert not gone(trainer.pid) and not trainer.failed
        assert trainer.state_dict() is not None  # what the parent's checkpoint saves
        monkeypatch.setenv("RLSPEC_DRAFTER_TIMEOUT_S", "1")
        os.kill(trainer.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(DrafterTrainerTimeout, match="did not answer a 'train' request within 1 s"):
                trainer.train_steps(1)
            assert time.monotonic() - start < 10
            assert trainer.state_dict() is None
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
    finally:
        eng.close()
    assert wait_for(lambda: gone(trainer.pid), 30)
