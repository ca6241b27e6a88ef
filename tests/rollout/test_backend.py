"""The rollout backend registry and protocol (rollout/backend.py)."""
from __future__ import annotations

import pytest

from rlspec.rollout.backend import BACKENDS, RolloutBackend, build_backend, register_backend
from rlspec.rollout.types import SamplingParams
from tests.conftest import make_tiny_hf, random_prompts


def test_the_engine_is_a_rollout_backend_and_generates_prompt_major():
    hf, tok = make_tiny_hf("llama"), None
    engine = build_backend("engine", hf, tok, None, max_model_len=64, max_num_seqs=4, dtype="float32")
    assert isinstance(engine, RolloutBackend)
    assert not engine.has_learned_drafter
    results = engine.generate(random_prompts(2), SamplingParams(n=2, max_new_tokens=4, seed=0, ignore_eos=True))
    assert [(r.prompt_index, r.sample_index) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown rollout backend 'nope'.*engine.*rollout.backend"):
        build_backend("nope", None, None, None)


def test_a_backend_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register_backend("engine")(lambda *a, **k: None)
    assert "engine" in BACKENDS
