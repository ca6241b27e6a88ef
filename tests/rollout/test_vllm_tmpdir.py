"""The vLLM backend's policy copies never outlive their run (rollout/vllm_backend/scratch.py, backend.py).

Without vLLM (it lives in another environment): ScratchDir is plain Python and is tested with real
processes that crash, exit and get SIGKILLed; the backend's own start-up and close are tested with a
stand-in `vllm` module whose LLM checks the copy it would load from and can fail like a real start."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from rlspec.rollout.vllm_backend.scratch import ScratchDir, process_tag, scratch_root, sweep_stale

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, sys
from pathlib import Path
from rlspec.rollout.vllm_backend.scratch import ScratchDir
d = ScratchDir.create("rlspec-vllm-", root=Path(sys.argv[1]))
(d.path / "policy").mkdir()
print(d.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("the run crashed")  # uncaught: the interpreter still exits normally
"""


def child(root: Path, how: str) -> Path:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), how], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert proc.returncode != 0 and proc.stdout.strip(), proc.stderr
    return Path(proc.stdout.strip())


def test_close_removes_the_directory_and_its_process_dir(tmp_path):
    d = ScratchDir.create("rlspec-vllm-", root=tmp_path)
    assert d.path.parent == tmp_path / process_tag() and d.path.name.startswith("rlspec-vllm-")
    (d.path / "policy").mkdir()
    other = ScratchDir.create("rlspec-vllm-", root=tmp_path)
    d.close()
    assert not d.path.exists() and d.closed and other.path.exists()  # the sibling keeps the process dir
    d.close()  # idempotent
    other.close()
    assert list(tmp_path.iterdir()) == []


def test_an_owner_collected_without_close_takes_its_directory_along(tmp_path):
    d = ScratchDir.create(root=tmp_path)
    path = d.path
    del d
    gc.collect()
    assert not path.exists()


def test_a_crashed_run_cleans_up_at_exit_and_a_killed_one_at_the_next_start(tmp_path):
    crashed = child(tmp_path, "raise")
    assert not crashed.exists()  # the finalizer ran at interpreter exit, exception and all
    killed = child(tmp_path, "kill")
    assert (killed / "policy").is_dir()  # SIGKILL runs no Python: left behind...
    alive = tmp_path / process_tag(os.getppid())  # ...next to the directory of a process that still runs
    alive.mkdir()
    reused = tmp_path / f"{os.getpid()}-1"  # our pid, another start time: an earlier process with our pid
    reused.mkdir()
    fresh = ScratchDir.create(root=tmp_path)  # ...until the next start sweeps the dead processes' leftovers
    assert not killed.parent.exists() and not reused.exists() and alive.is_dir() and fresh.path.is_dir()
    assert sweep_stale(tmp_path) == []
    fresh.close()


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A `vllm` module whose LLM checks the policy copy it loads from and fails when told to."""
    seen: dict = {}

    class LLM:
        def __init__(self, model: str, **kwargs):
            seen["model"] = Path(model)
            assert (Path(model) / "config.json").is_file() and (Path(model) / "model.safetensors").is_file()
            if seen.get("fail"):
                raise RuntimeError("CUDA out of memory (the start-up failed)")

        def get_metrics(self):
            return []

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    from rlspec.rollout.vllm_backend import cpu_fixes

    monkeypatch.setattr(cpu_fixes, "apply", lambda: None)  # it patches vLLM internals the stand-in lacks
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return seen


def test_the_backend_s_policy_copy_goes_on_close_and_on_a_failed_start(fake_vllm, tmp_path):
    from rlspec.rollout.vllm_backend.backend import VLLMBackend
    from tests.conftest import make_tiny_hf

    hf = make_tiny_hf("llama", seed=1)
    backend = VLLMBackend(hf, None, max_model_len=64, max_num_seqs=2)
    copy = fake_vllm["model"]
    assert copy.is_dir() and copy.is_relative_to(scratch_root())
    backend.close()
    assert not copy.exists()
    fake_vllm["fail"] = True
    with pytest.raises(RuntimeError, match="out of memory"):
        VLLMBackend(hf, None, max_model_len=64, max_num_seqs=2)
    assert fake_vllm["model"] != copy and not fake_vllm["model"].exists()
    assert not scratch_root().exists() or list(scratch_root().iterdir()) == []
