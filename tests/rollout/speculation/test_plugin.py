"""A newcomer adds a drafter by writing one file and registering it; the engine then builds it by name."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.registry import DRAFTERS
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

TOY = '''
"""Toy drafter: proposes the sequence's last token again, k times (a chain)."""
from rlspec.rollout.speculation.drafters.base import DRAFTERS, Draft


class RepeatDrafter:
    name = "toy_repeat"

    def __init__(self, proposed=0):
        self.proposed = proposed

    def begin(self, groups):
        pass

    def finish(self, seq):
        pass

    def propose(self, seqs, max_tokens, width):
        self.proposed += sum(max_tokens)
        return [Draft.chain([s.pending] * cap) for s, cap in zip(seqs, max_tokens)]


@DRAFTERS.register("toy_repeat", learned=False, auto=False)
def build(target=None, spec=None, **overrides):
    return RepeatDrafter(**overrides)
'''


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    (tmp_path / "toy_drafter.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("toy_drafter")
    sys.modules.pop("toy_drafter", None)


def test_unregistered_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="registered: eagle3, ngram, ngram_device, suffix, suffix_device"):
        SpecConfig(drafter="toy_never_registered")


def test_a_one_file_drafter_plugs_in_by_name(toy_module):
    assert "toy_repeat" in DRAFTERS.names()
    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(5, 3, 12, seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=16)
    spec = SpecConfig(drafter="toy_repeat", selector="always", num_draft_tokens=3)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    out = [r.completion_ids for r in eng.generate(prompts, params)]
    plain = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
    assert out == [r.completion_ids for r in plain.generate(prompts, params)]  # lossless whatever it drafts
    assert eng.speculation.by_name["toy_repeat"].proposed > 0  # the registered drafter really drafted
    assert eng.stats()["rollout/spec_step_share"] > 0.5
