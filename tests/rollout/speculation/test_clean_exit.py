"""An engine whose drafter trains online exits cleanly, in a thread or in a process of its own:
close(), `with`, and plain interpreter exit (status 0, no trainer process left behind)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    import time
    from rlspec.rollout.engine import RolloutEngine
    from rlspec.rollout.runtime.model import loader
    from rlspec.rollout.speculation.training.trainer_process import ProcessTrainer
    from rlspec.rollout.types import SamplingParams, SpecConfig
    from tests.conftest import make_tiny_hf, random_prompts

    MODE = {mode!r}
    hf = make_tiny_hf("llama", seed=1)
    # a process trainer takes its settings when its child starts: the engine starts none (a child spawned only to
    # be stopped) and the script attaches one with its own, as the engine would have (Speculation.attach_trainer)
    spec = SpecConfig(drafter="auto", online_training=MODE == "thread", online_trainer=MODE)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    if MODE == "thread":
        eng.speculation.trainer.min_tokens = 16
    else:
        assert eng.speculation.trainer is None
        eng.speculation.attach_trainer(ProcessTrainer(eng.speculation.learned, min_tokens=16))
    eng.generate(random_prompts(4, 3, 10, seed=1), SamplingParams(temperature=1.0, max_new_tokens=48, n=4, seed=0))
    trainer = eng.speculation.trainer
    if MODE == "thread":
        assert trainer._thread.is_alive()  # the training thread is still running at exit
    else:
        deadline = time.time() + 120
        while trainer.stats.steps == 0 and time.time() < deadline:  # exit while the child trains
            time.sleep(0.05)
        assert trainer._proc.is_alive() and trainer.stats.steps > 0
        print("pid", trainer.pid, flush=True)
    print("done", flush=True)
''')


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_script_with_online_training_exits_zero(mode):
    # before the fix the thread version aborted with "terminate called without an active exception" (134)
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(mode=mode)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done" in out.stdout and "terminate called" not in out.stderr
    if mode == "process":
        pid = int(out.stdout.split("pid ")[1].split()[0])
        deadline = time.time() + 10
        while not _gone(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the trainer process outlived the rollout process"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_close_and_with_stop_training_and_keep_the_drafter(tmp_path, mode):
    hf = make_tiny_hf("llama", seed=2)
    spec = SpecConfig(drafter="eagle3", online_training=True, online_trainer=mode)
    with RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2]) as eng:
        eng.generate(random_prompts(2, 3, 8, seed=2), SamplingParams(max_new_tokens=8, seed=0))
        trainer = eng.speculation.trainer
        worker = trainer._thread if mode == "thread" else trainer._proc
        assert worker.is_alive()
    assert not worker.is_alive()
    if mode == "process":
        assert worker.exitcode == 0
    assert (Path(eng.export_drafter(str(tmp_path / "d"))) / "model.safetensors").is_file()  # the drafter is kept
    eng.generate(random_prompts(2, 3, 8, seed=3), SamplingParams(max_new_tokens=8, seed=0))  # still usable
