"""An out-of-memory step of the online drafter trainer (the GPU is shared with the rollout and the policy update)
backs off to a smaller batch and retries; training goes on instead of ending for the rest of the run."""
import time

import torch

from rlspec.rollout.speculation.training import drafter_training
from rlspec.rollout.speculation.training.drafter_training import DrafterTrainer
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_eagle3 import eagle_engine


def _trainer(batch: int):
    eng = eagle_engine(make_tiny_hf("llama", seed=10))
    trainer = eng.speculation.attach_trainer(DrafterTrainer(eng.speculation.learned, batch=batch, window=8,
                                                            min_tokens=1))
    eng.generate(random_prompts(2, 4, 6), SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    trainer.oom_wait_s = 0.01
    trainer.engine = eng  # the test holds the engine: a collected engine stops its trainer
    return trainer


def _oom_while_batch_above(trainer, limit: int):
    """The trainer's step raises the device's out-of-memory error while its batch is above `limit`."""
    step, batches = trainer._step, []

    def limited():
        batches.append(trainer.batch)
        if trainer.batch > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        step()

    trainer._step = limited
    return batches


def _run_until(trainer, done, timeout=20.0):
    trainer.start()
    trainer.set_idle(True)
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline and trainer._thread.is_alive():
        time.sleep(0.02)
    trainer.stop()


def test_an_out_of_memory_step_halves_the_batch_and_training_goes_on():
    trainer = _trainer(batch=8)
    batches = _oom_while_batch_above(trainer, 2)
    _run_until(trainer, lambda: trainer.stats.steps >= 3)
    assert trainer.stats.error is None  # before the back-off: the first OOM ended training (drafter/failed)
    assert trainer.stats.steps >= 3 and trainer.stats.ooms == 2
    assert batches[:3] == [8, 4, 2] and trainer.batch == 2
    m = trainer.metrics(0)
    assert m["drafter/failed"] == 0.0 and m["drafter/ooms"] == 2.0 and m["drafter/batch"] == 2.0
    # what training allocated after its build (gradients, AdamW's moments) is within the KV pool's reserve for it
    held = sum(t.numel() * t.element_size() for st in trainer.opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
    held += sum(p.grad.numel() * p.grad.element_size() for p in trainer.model.parameters() if p.grad is not None)
    assert 0 < held <= trainer.memory_bytes()


def test_the_batch_grows_back_after_good_steps(monkeypatch):
    monkeypatch.setattr(drafter_training, "OOM_RECOVER_STEPS", 2)
    trainer = _trainer(batch=4)
    batches = _oom_while_batch_above(trainer, 4)  # never refuses: a pretended earlier OOM left batch 2
    trainer.batch = 2
    _run_until(trainer, lambda: trainer.stats.steps >= 3)
    assert batches[:3] == [2, 2, 4] and trainer.batch == 4 and trainer.stats.error is None



def test_a_synchronous_caller_sees_the_back_off_not_the_error():
    """train_steps (scripts, the trainer process's loop) backs off the same way and returns; the next call trains."""
    trainer = _trainer(batch=8)
    _oom_while_batch_above(trainer, 4)
    trainer.train_steps(3)  # raised torch.OutOfMemoryError before the back-off
    assert trainer.stats.ooms == 1 and trainer.stats.steps == 0 and trainer.batch == 4
    trainer.train_steps(3)
    assert trainer.stats.steps == 3 and trainer.stats.ooms == 1


def test_the_kv_pool_leaves_room_for_an_online_drafter_trainer_on_its_device():
    """The engine registers its thread trainer's estimate among the runner's reserves (the KV pool's growth keeps
    them free on CUDA: docs/runtime.md#memory-plan); without a trainer there is nothing to reserve."""
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.types import SpecConfig

    hf = make_tiny_hf("llama", seed=10)
    spec = SpecConfig(drafter="eagle3", online_training=True, online_trainer="thread")
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=4)
    try:
        assert eng.runner.reserves["drafter"] == eng.speculation.trainer.memory_bytes() > 0
    finally:
        eng.close()
    off = RolloutEngine(loader.from_hf_model(hf), None, spec=SpecConfig(drafter="eagle3", online_training=False),
                        eos_token_ids=[2], max_num_seqs=4)
    assert "drafter" not in off.runner.reserves
