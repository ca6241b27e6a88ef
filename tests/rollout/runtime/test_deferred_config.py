"""The drafter trainer's child gets the target's transformers config deferred (config.DeferredConfig): a field
is read from the config's dict, and only anything else rebuilds the config (importing transformers, ~2 s)."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch

from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.model.config import DeferredConfig
from rlspec.rollout.runtime.model.rotary import rope_table
from tests.conftest import make_tiny_hf

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import pickle, sys
cfg = pickle.loads(sys.stdin.buffer.read())
from rlspec.rollout.runtime.model.rotary import rope_table
cos, sin = rope_table(cfg, 16, "cpu")
assert "transformers" not in sys.modules, "a RoPE table of a field read from the dict imported transformers"
assert cfg.hf_config.get_text_config().vocab_size == cfg.vocab_size  # a method: the config rebuilt
assert "transformers" in sys.modules
sys.stdout.buffer.write(pickle.dumps((cos, sin)))
"""


def test_the_child_s_rope_tables_need_no_transformers_and_equal_the_engine_s():
    model = loader.from_hf_model(make_tiny_hf("llama", rope_theta=5000.0))
    portable = model.cfg.portable()
    assert isinstance(portable.hf_config, DeferredConfig) and portable.vocab_size == model.cfg.vocab_size
    out = subprocess.run([sys.executable, "-c", CHILD], input=pickle.dumps(portable), capture_output=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    cos, sin = pickle.loads(out.stdout)
    ref = rope_table(model.cfg, 16, "cpu")
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
