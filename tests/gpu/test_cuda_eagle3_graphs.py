"""EAGLE-3's draft levels and catch-ups replayed from CUDA graphs (drafters/eagle3_graphs.py): the same drafts and
catch-up outputs as the eager ones on the same inputs (float32), greedy exactness of the rollout through them
(chains and trees), one capture per key and replays after."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.speculation.test_eagle3_graphs import caught_up_both_ways, drafted_both_ways

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(hf, width: int, graph_mode: str):
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=4, tree_width=width, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf, torch.float32, "cuda"), None, spec=spec, eos_token_ids=[2])
    eng.speculation.learned.graph_mode = graph_mode
    # step by step: a chain looked ahead (CUDA's default) drafts through the graphs alone, with no eager levels to
    # compare with (tests/gpu/test_cuda_eagle3_ahead.py: its rollouts against step-by-step ones)
    eng.look_ahead = False
    with torch.no_grad():
        eng.speculation.learned.model.lm_head.weight.mul_(8.0)
    eng.speculation.force(Arm("eagle3", 4, width))
    return eng


@pytest.mark.parametrize("width", [1, 2])
def test_cuda_graph_levels_give_the_eager_drafts_and_stay_exact(width, monkeypatch):
    hf = make_tiny_hf("llama", seed=6).cuda()
    prompts = random_prompts(5, 3, 20, seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    plain = RolloutEngine(loader.from_hf_model(hf, torch.float32, "cuda"), None, eos_token_ids=[2])
    ref = [r.completion_ids for r in plain.generate(prompts, params)]
    eng = _engine(hf, width, "auto")
    draft, compared = Eagle3Drafter._draft, []

    def both(self, seqs, h, depth, w):
        graphs = self._graphs
        self._graphs, self.graph_mode = None, "off"
        eager = draft(self, seqs, h, depth, w)
        self._graphs, self.graph_mode = graphs, "auto"
        got = draft(self, seqs, h, depth, w)
        assert torch.equal(got[0], eager[0]), "graph levels drafted other tokens than eager ones"
        compared.append(depth)
        return got

    monkeypatch.setattr(Eagle3Drafter, "_draft", both)
    # every catch-up run eagerly too (the pool, the staged features and the table read and written in place)
    caught_up = caught_up_both_ways(monkeypatch, "auto")
    assert [r.completion_ids for r in eng.generate(prompts, params)] == ref
    graphed = [(c, key) for c, key in caught_up if key is not None]
    # a catch-up a proposal (the prompt's: eager if long), run early after the verify of the one before, and one
    # after the last verify (and a proposal's own after a step nobody drafted in: capped drafts near a row's end)
    assert len(compared) <= len(caught_up) <= len(compared) + 3 and len(graphed) >= len(compared) - 1
    graphs = eng.speculation.learned.level_graphs()
    assert graphs is not None and graphs.graphs.backend == "cuda"
    assert graphs.counts["captures"] == len(graphs.graphs.graphs) > 0
    # every level (a tree's root children's included) and a catch-up graph a proposal (a long one: eager)
    assert graphs.counts["replays"] == sum(d for d in compared if d > 1) + len(graphed)
    assert graphs.counts["replays"] > graphs.counts["captures"]


def test_cuda_sampled_graph_levels_draw_the_eager_drafts(monkeypatch):
    """Sampled proposals (top-p, a repetition penalty, the max_conf stop rule) drafted twice from the same CUDA
    generator state, eagerly and through the level graphs, whose draws run inside them: the same tokens from the
    same uniforms, q to rounding (the graphs attend over padded context buckets), the same kept nodes."""
    hf = make_tiny_hf("llama", seed=6).cuda()
    prompts = random_prompts(5, 3, 20, seed=4)
    eng = _engine(hf, 1, "auto")
    eng.speculation.force(Arm("eagle3", 4, 1, "max_conf"))
    compared = drafted_both_ways(monkeypatch, "auto")
    caught_up = caught_up_both_ways(monkeypatch, "auto")
    eng.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, max_new_tokens=16,
                                         ignore_eos=True, seed=1))
    graphs = eng.speculation.learned.level_graphs()
    assert len(compared) > 3 and graphs.counts["replays"] > graphs.counts["captures"] > 0
    assert sum(key is not None for _, key in caught_up) >= len(compared) - 1
