"""EAGLE-3's draft levels from graphs (drafters/eagle3_graphs.py), their bookkeeping exercised on the CPU: an
"emulate" graph replays by calling the captured closure, which reads only the static buffers, so the keys, the
row and context buckets and the padding of rows are the CUDA path's; the drafts equal the eager ones."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
from rlspec.rollout.speculation.drafters.eagle3_graphs import MAX_CATCH_UP_POSITIONS, Held, pow2_at_least, row_bucket
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts


def _engine(hf, width: int, graph_mode: str, k: int = 4, stop: str = "none", sharpen: float = 8.0):
    spec = SpecConfig(drafter="eagle3", num_draft_tokens=k, tree_width=width, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    eng.speculation.learned.graph_mode = graph_mode
    eng.speculation.learned.early = True  # the catch-up before the read, as on CUDA, where the graphs run
    with torch.no_grad():  # a sharper head: drafts that differ between rows and levels
        eng.speculation.learned.model.lm_head.weight.mul_(sharpen)
    eng.speculation.force(Arm("eagle3", k, width, stop))
    return eng


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 40)] == [1, 2, 4, 8, 8, 16, 16, 32, 48]
    assert [pow2_at_least(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


@pytest.mark.parametrize("width", [1, 2])
def test_graph_levels_give_the_eager_drafts(width, monkeypatch):
    """Every proposal of a greedy rollout drafted twice, eagerly and through the emulated graphs, on the same
    inputs: the same tokens, row for row, at live batches 5, 3 and 1 (rows x width padded to buckets 1-16)."""
    from rlspec.rollout.speculation.drafters import eagle3_graphs as G

    monkeypatch.setattr(G, "MAX_FRAMES", 64)  # every key kept: captures count keys
    hf = make_tiny_hf("llama", seed=6)
    prompts = random_prompts(5, 3, 20, seed=3)
    eng = _engine(hf, width, "emulate")
    drafter: Eagle3Drafter = eng.speculation.learned
    draft, compared = Eagle3Drafter._draft, []

    def both(self, seqs, h, depth, w):
        graphs = self._graphs
        self._graphs, self.graph_mode = None, "off"
        eager = draft(self, seqs, h, depth, w)
        self._graphs, self.graph_mode = graphs, "emulate"
        got = draft(self, seqs, h, depth, w)
        assert torch.equal(got[0], eager[0]) and kept_of(got) == kept_of(eager)
        compared.append((len(seqs), depth))
        return got

    monkeypatch.setattr(Eagle3Drafter, "_draft", both)
    catch_up, catch_ups = G.DraftLevelGraphs.catch_up, []
    monkeypatch.setattr(G.DraftLevelGraphs, "catch_up", lambda self, *a: catch_ups.append(1) or catch_up(self, *a))
    for n in (5, 3, 1):
        eng.generate(prompts[:n], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True))
    counts = drafter.level_graphs().counts
    assert len(compared) >= 30 and {b for b, _ in compared} == {5, 3, 1}
    # one graph per (row bucket, context bucket, capacity, level): captured once, replayed by every proposal of
    # two levels or more (every level, a tree's root children included); and one catch-up graph per (row bucket,
    # positions bucket, context bucket), replayed once a proposal (a whole prompt's runs eagerly)
    keys = drafter.level_graphs().graphs.graphs
    assert counts["captures"] == len(keys)
    assert counts["replays"] == sum(d for _, d in compared if d > 1) + len(catch_ups)
    # a catch-up a proposal, run early after the verify of the one before (a call's first, over its prompt, runs
    # eagerly); the early run after a call's last verify serves no proposal, and one after a step nobody drafted in
    # (capped drafts near the end) runs at the next proposal
    assert len(compared) <= len(catch_ups) <= len(compared) + 6
    keys = [k for k in keys if k[0] != "catch_up"]
    assert {k[0] for k in keys} == {row_bucket(b) * width for b in (5, 3, 1)}  # whole branch groups
    assert {k[3] for k in keys} == set(range(4))
    assert {k[5] for k in keys if k[3] == 0} == {width} and {k[5] for k in keys if k[3] > 0} == {1}
    assert {k[2] for k in keys} == {4}  # proposals capped near the end reuse the full depth's frames


def caught_up_both_ways(monkeypatch, graph_mode: str) -> list:
    """Make every catch-up (a proposal's, and the early one after a verify, eagle3_catch_up.py) run twice on the same
    state, eagerly and through its graph (`graph_mode`; rows, positions and context padded to the key's buckets), and
    assert the same outputs to rounding (the graph attends over its context bucket, masked past each row). Returns
    the list the catch-ups' (positions per row, key replayed or None: ran eagerly) go to."""
    real, seen = Eagle3Drafter._run_catch_up, []

    def both(self, B, C, end, inputs, full):
        graphs = self._graphs
        self._graphs, self.graph_mode = None, "off"
        eager = real(self, B, C, end, inputs, full)
        self._graphs, self.graph_mode = graphs, graph_mode
        replays = self.level_graphs().counts["replays"]
        got = real(self, B, C, end, inputs, full)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        graphed = self.level_graphs().counts["replays"] > replays
        counts = [int(n) + 1 for n in inputs(B, C)[B * 4 * C:]]  # each row's last query, counted from 0
        seen.append((counts, next(reversed(self.level_graphs().catch_ups)) if graphed else None))
        return got

    monkeypatch.setattr(Eagle3Drafter, "_run_catch_up", both)
    return seen


def test_graph_catch_up_gives_the_eager_outputs(monkeypatch):
    """Every catch-up of a sampled rollout run eagerly and through its emulated graph gives the same outputs
    (`caught_up_both_ways`); the catch-ups covered rows padded to a bucket, several positions a row and rows of
    unequal counts."""
    hf = make_tiny_hf("llama", seed=6)
    eng = _engine(hf, 1, "emulate", sharpen=2.0)
    seen = caught_up_both_ways(monkeypatch, "emulate")
    prompts = random_prompts(5, 3, 20, seed=5)
    for n in (5, 3):
        eng.generate(prompts[:n], SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=n))
    graphed = [(c, key) for c, key in seen if key is not None]
    assert len(graphed) >= 10
    assert any(key[1] > len(c) for c, key in graphed)  # rows padded to a bucket
    assert any(key[2] > max(c) > 1 for c, key in graphed)  # several positions a row, padded
    assert any(min(c) < max(c) for c, _ in graphed)
    # a catch-up of more positions a row than MAX_CATCH_UP_POSITIONS (a whole prompt, here) runs eagerly
    assert all((key is None) == (max(c) > MAX_CATCH_UP_POSITIONS) for c, key in seen)
    assert any(key is None for _, key in seen)


def _held(hf, blocks: int = 8, bs: int = 16, table_rows: int = 16, width: int = 4) -> Held:
    """A Held over random pools of the tiny model's KV shape: every table row's blocks 1..width."""
    KV, D = hf.config.num_key_value_heads, hf.config.hidden_size // hf.config.num_attention_heads
    k = torch.randn(blocks, bs, KV, D)
    table = torch.arange(1, width + 1).repeat(table_rows, 1)
    return Held(k, k.clone(), table, torch.zeros(blocks, bs, 3 * hf.config.hidden_size), torch.ones(64, D),
                torch.zeros(64, D), bs, width * bs)


def test_catch_up_graphs_go_with_what_they_address(monkeypatch):
    """The graphs hold the pool's, the table's and the RoPE tables' addresses (`Held`): another binding drops every
    frame and graph, and at most MAX_CATCH_UPS catch-ups are kept, the least recently used going first."""
    from rlspec.rollout.speculation.drafters import eagle3_graphs as G

    monkeypatch.setattr(G, "MAX_CATCH_UPS", 2)
    hf = make_tiny_hf("llama", seed=1)
    drafter = Eagle3Drafter(loader.from_hf_model(hf), draft_vocab_size=32, graph_mode="emulate")
    graphs, H, held = drafter.level_graphs(), hf.config.hidden_size, _held(hf)
    calls = []

    def forward(grid, s):
        calls.append((tuple(grid.shape), s))
        return grid[:, 0, :, None].float().expand(-1, -1, H) + grid[:, 1, :, None]  # token + slot, per position

    def catch_up(rows, c, s, held):  # the grid 0, 1, 2, ... (a row's tokens, then its slots, ...)
        return graphs.catch_up(held, torch.tensor(list(range(rows * 4 * c)) + [c - 1] * rows), (rows, c), s, forward)

    out = catch_up(2, 2, 16, held)
    assert out.shape == (2, H) and out[1, 0] == 8 * 1 + 1 + 8 * 1 + 2 + 1  # row 1's last position: token + slot
    catch_up(2, 2, 16, held)
    catch_up(4, 1, 16, held)
    catch_up(1, 4, 32, held)
    assert list(graphs.catch_ups) == [("catch_up", 4, 1, 16), ("catch_up", 1, 4, 32)]
    assert set(graphs.graphs.graphs) == set(graphs.catch_ups) and graphs.counts["captures"] == 3
    catch_up(1, 4, 32, _held(hf))  # another pool: every graph captured again
    assert set(graphs.graphs.graphs) == {("catch_up", 1, 4, 32)} and graphs.counts["captures"] == 4
    assert calls[-1] == ((1, 4, 4), 32)


def test_least_recently_used_frames_go_with_their_graphs(monkeypatch):
    """At most MAX_FRAMES level frames are kept; a frame that goes takes its levels' graphs along. A level's
    context bucket is whole blocks, a power of two up to the cache's length."""
    from rlspec.rollout.speculation.drafters import eagle3_graphs as G

    monkeypatch.setattr(G, "MAX_FRAMES", 2)
    hf = make_tiny_hf("llama", seed=1)
    drafter = Eagle3Drafter(loader.from_hf_model(hf), draft_vocab_size=32, graph_mode="emulate")
    graphs, H, held = drafter.level_graphs(), hf.config.hidden_size, _held(hf, width=3)

    def propose(rows, ctx):
        def pick(h, ids, seen, u, k):
            return ids[h[:, :32].argmax(-1)], None, None

        return graphs.draws(held, torch.tensor, list(range(rows)), [ctx] * rows, 3, 1, torch.randn(rows, H), None,
                            None, torch.arange(32), pick, lambda t: torch.randn(len(t), 1, H), ("greedy",))[0]

    for rows, ctx in ((1, 10), (3, 16), (1, 5), (9, 40)):
        assert propose(rows, ctx).shape == (rows, 3)
    assert list(graphs.frames) == [(1, 16, 4), (16, 48, 4)]  # (4, 16) was the least recently used; 64 > 3 blocks
    assert {k[:3] for k in graphs.graphs.graphs} == {(1, 16, 4), (16, 48, 4)}


def kept_of(drafted) -> list[int]:
    """_draft's nodes kept per row (all of them without a stop rule)."""
    ids, _, kept = drafted
    return [ids.shape[1] * ids.shape[2]] * len(ids) if kept is None else kept.tolist()


def drafted_both_ways(monkeypatch, graph_mode: str) -> list:
    """Make every sampled proposal draft twice from the same generator state, eagerly and through the level graphs
    (`graph_mode`), and assert the same tokens and kept nodes, and q to rounding: a graph attends over its frame's
    context bucket, padded past the rows' context with masked positions, which changes the order of the sums.
    Returns the list the proposals' (rows, depth, kept) go to."""
    draft, compared = Eagle3Drafter._draft, []

    def both(self, seqs, h, depth, w):
        graphs, state = self._graphs, self.generator.get_state()
        self._graphs, self.graph_mode = None, "off"
        eager = draft(self, seqs, h, depth, w)
        self._graphs, self.graph_mode = graphs, graph_mode
        self.generator.set_state(state)
        got = draft(self, seqs, h, depth, w)
        assert torch.equal(got[0], eager[0]) and kept_of(got) == kept_of(eager)
        torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-6)
        compared.append((len(seqs), depth, kept_of(got)))
        return got

    monkeypatch.setattr(Eagle3Drafter, "_draft", both)
    return compared


SAMPLED = {  # how the levels draw: each a different graph (its key's `sig`) and a different part of _pick
    "plain": (dict(temperature=1.0), "none"),
    "processed": (dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02), "max_conf"),
    "penalised": (dict(temperature=1.3, repetition_penalty=1.4), "entropy"),
}


@pytest.mark.parametrize("case", list(SAMPLED))
@pytest.mark.parametrize("width", [1, 2])
def test_sampled_graph_levels_draw_the_eager_drafts(case, width, monkeypatch):
    """Sampled proposals drafted twice from the same generator state, eagerly and through the emulated graphs:
    the same tokens from the same uniforms, the same distributions q (the law verification divides by) to
    rounding and the same kept nodes under a stop rule; so the graphs draw from the law the eager levels draw
    from, which the law tests check (tests/rollout/speculation/test_eagle3.py)."""
    kw, stop = SAMPLED[case]
    hf = make_tiny_hf("llama", seed=6)
    prompts = random_prompts(5, 3, 20, seed=4)
    eng = _engine(hf, width, "emulate", stop=stop, sharpen=2.0)
    compared = drafted_both_ways(monkeypatch, "emulate")
    for n in (5, 2):
        eng.generate(prompts[:n], SamplingParams(max_new_tokens=16, ignore_eos=True, seed=n, **kw))
    assert len(compared) >= 10 and eng.speculation.learned.level_graphs().counts["replays"] > 0
    if stop != "none":  # the stop rule cut some drafts short, so its verdicts came from the graphs
        assert any(min(kept) < depth * width for _, depth, kept in compared)


def test_iid_tree_roots_from_graphs_draw_the_eager_drafts(monkeypatch):
    """A tree's root children drawn i.i.d. (tree_draws="iid": one call of uniforms over the repeated rows, not one a
    child) are the eager ones from the graph too."""
    hf = make_tiny_hf("llama", seed=6)
    eng = _engine(hf, 2, "emulate", sharpen=2.0)
    eng.speculation.learned.tree_draws = "iid"
    compared = drafted_both_ways(monkeypatch, "emulate")
    eng.generate(random_prompts(3, 3, 20, seed=4), SamplingParams(max_new_tokens=16, ignore_eos=True, seed=1,
                                                                  temperature=1.0))
    keys = eng.speculation.learned.level_graphs().graphs.graphs
    assert len(compared) >= 5 and any(k[3] == 0 and k[5] == 2 for k in keys)  # the roots came from a graph


def test_graph_levels_keep_greedy_exactness():
    """The rollout through the emulated graph levels equals plain decoding (chains and trees)."""
    hf = make_tiny_hf("llama", seed=8)
    prompts = random_prompts(3, 3, 20, seed=8)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    plain = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2]).generate(prompts, params)
    for width in (1, 2):
        got = _engine(hf, width, "emulate").generate(prompts, params)
        assert [r.completion_ids for r in got] == [r.completion_ids for r in plain]


def test_graph_mode_is_checked_and_off_on_a_cpu_by_default():
    hf = make_tiny_hf("llama", seed=1)
    target = loader.from_hf_model(hf)
    with pytest.raises(ValueError, match="graph_mode"):
        Eagle3Drafter(target, draft_vocab_size=32, graph_mode="on")
    assert Eagle3Drafter(target, draft_vocab_size=32).level_graphs() is None  # "auto" on a CPU: eager
