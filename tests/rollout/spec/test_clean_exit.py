"""An engine whose drafter trains online exits cleanly: close(), `with`, and plain interpreter exit."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from rollout.engine import RolloutEngine
from rollout.runtime.model import loader
from rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent('''
    from rollout.engine import RolloutEngine
    from rollout.runtime.model import loader
    from rollout.types import SamplingParams, SpecConfig
    from tests.conftest import make_tiny_hf, random_prompts

    hf = make_tiny_hf("llama", seed=1)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=SpecConfig(drafter="auto"), eos_token_ids=[2])
    eng.speculation.trainer.min_tokens = 16
    eng.generate(random_prompts(4, 3, 10, seed=1), SamplingParams(temperature=1.0, max_new_tokens=48, n=4, seed=0))
    assert eng.speculation.trainer._thread.is_alive()  # the training thread is still running at exit
    print("done", flush=True)
''')


def test_script_with_online_training_exits_zero():
    # before the fix this aborted with "terminate called without an active exception" (status 134)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done" in out.stdout and "terminate called" not in out.stderr


def test_close_and_with_stop_training_and_keep_the_drafter(tmp_path):
    hf = make_tiny_hf("llama", seed=2)
    with RolloutEngine(loader.from_hf_model(hf), None, spec=SpecConfig(drafter="eagle3"), eos_token_ids=[2]) as eng:
        eng.generate(random_prompts(2, 3, 8, seed=2), SamplingParams(max_new_tokens=8, seed=0))
        thread = eng.speculation.trainer._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    assert (Path(eng.export_drafter(str(tmp_path / "d"))) / "model.safetensors").is_file()  # the drafter is kept
    eng.generate(random_prompts(2, 3, 8, seed=3), SamplingParams(max_new_tokens=8, seed=0))  # still usable
