"""rollout/runtime/model/fused.py: the fused CPU step (kernels/decoder_layer.cpp).

It must be the eager layer: with the same products (the kernel's) and the same attention, every value the op
writes (hidden states, keys and values in the pool, logits) equals the eager layer's except where float32
summation order moves a value across a bf16 rounding boundary. And it must keep speculation exact: a token's
logits are the same bits whether a verify of several tokens or a step of one computed them, so greedy decoding
gives the same tokens with and without speculation."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.blocks import TRASH
from rlspec.rollout.runtime.compiled import CompiledRunner
from rlspec.rollout.runtime.graphs import EagerRunner
from rlspec.rollout.runtime.model import fused, kernels, loader
from rlspec.rollout.runtime.model.linear import Linear
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts
from tests.rollout.runtime.test_graphs import _runner, _tokens, _tree
from tests.rollout.runtime.test_kernels import _bf16_ulps

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no AVX-512 BF16 CPU or no C++ toolchain")

HEAD32 = dict(head_dim=32)  # the kernels take whole 32-element steps per head; conftest's tiny model has 16


def _tiny_hf(kind="llama"):
    """conftest's tiny model with 32-wide heads and norm weights away from 1 (at 1 a norm's rounding points
    could not be told apart)."""
    hf = make_tiny_hf(kind, **HEAD32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return hf


def _fused_runner(kind="llama", rows=8, length=64):
    """A bf16 runner whose steps run fused, with 5 prompts prefilled into rows 0..4; returns (runner, lengths)."""
    from rlspec.rollout.runtime.runner import ModelRunner

    model = loader.from_hf_model(_tiny_hf(kind), torch.bfloat16, "cpu")
    runner = ModelRunner(model, "cpu", torch.bfloat16, compile_mode="on")
    runner.ensure_cache(rows, length).reserve_rows(rows, length)
    prompts = random_prompts(5, 3, 12, seed=3)
    runner.prefill(prompts, list(range(5)))
    assert isinstance(runner.steps, CompiledRunner) and runner.steps.fused is not None
    return runner, torch.tensor([len(p) for p in prompts])


def _kernel_products(self, x):
    """Linear.forward with the fused op's products: the eager reference then differs from it only in the ops
    around them."""
    return kernels.packed_linear(x, self._blocked, self.bias, self.out_features)


def _agree(got: torch.Tensor, ref: torch.Tensor, exact_share: float = 0.97, most: float = 2.0):
    """Equal bits for nearly every element; the rest one or two bf16 steps apart (summation order). Rounding an
    intermediate the eager layer rounds, or not rounding it, moves far more elements than 3%."""
    steps = _bf16_ulps(got, ref.double())
    assert (got == ref).float().mean() >= exact_share, (got == ref).float().mean()
    assert steps.max() <= most, steps.max()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("B,T,tree", [(1, 1, False), (4, 1, False), (1, 5, False), (2, 4, True)],
                         ids=["b1-decode", "b4-decode", "b1-chain5", "b2-tree"])
def test_fused_step_is_the_eager_step_around_the_same_products(kind, B, T, tree, monkeypatch):
    """Logits, every layer's hidden state and the keys and values written: the eager layers' (with the kernel's
    products), up to summation order. Two runners share nothing: each has its own cache, prefilled alike."""
    ref_runner, lens = _fused_runner(kind)
    got_runner, _ = _fused_runner(kind)
    start = lens[:B].clone()
    tokens = _tokens(B, T, seed=B + T)
    depths, mask = _tree(B) if tree else (None, None)
    layers = tuple(range(len(got_runner.model.model.layers) + 1))
    got, got_h = got_runner.steps.run(tokens, start, depths, mask, hidden_layers=layers)
    assert got_runner.steps.counts["fused"] == 1
    with monkeypatch.context() as m:
        m.setattr(Linear, "forward", _kernel_products)
        ref, ref_h = EagerRunner(ref_runner.model, ref_runner.cache, "cpu").run(tokens, start, depths, mask,
                                                                                 hidden_layers=layers)
    for i in layers:
        _agree(got_h[i], ref_h[i])
    for pool in ("k", "v"):  # the trash block (TRASH = 0) takes the prefills' padding, in any order
        _agree(getattr(got_runner.cache, pool)[:, TRASH + 1:], getattr(ref_runner.cache, pool)[:, TRASH + 1:])
    _agree(got, ref)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_verify_gives_each_token_the_bits_single_steps_give_it(tree):
    """What makes speculation exact on this path: each row's products, norms and attention are computed the same
    way whatever the number of tokens beside it, so the logits of a chain (or a tree's path) verified in one step
    equal, bit for bit, those of the same tokens fed one step at a time."""
    verify_runner, lens = _fused_runner()
    single_runner, _ = _fused_runner()
    B, T = 2, 4
    start = lens[:B].clone()
    tokens = _tokens(B, T, seed=5)
    depths, mask = _tree(B) if tree else (None, None)
    got = verify_runner.steps.run(tokens, start, depths, mask)[0]
    path = [0, 2, 3] if tree else list(range(T))  # the tree's nodes 0 -> 2 -> 3 form one root-to-leaf path
    for i, node in enumerate(path):
        one = single_runner.steps.run(tokens[:, node:node + 1], start + i)[0]
        assert torch.equal(one[:, 0], got[:, node]), (i, node)
    assert verify_runner.steps.counts["fused"] == 1 and single_runner.steps.counts["fused"] == len(path)


def test_fused_engine_greedy_is_the_same_with_and_without_speculation():
    """bf16 on the fused path: chains and trees of suffix drafts give plain decoding's tokens, token for token,
    and drafts were accepted (so verifies of several tokens ran). Two rows, so that every step is fused (up to 16
    tokens a step): a step of another path rounds differently, and which steps took it would change the tokens."""
    hf = _tiny_hf()
    prompts = random_prompts(2, 4, 20, seed=7)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    outputs, engines = [], []
    for spec in (None, SpecConfig(drafter="suffix", num_draft_tokens=3, selector="always"),
                 SpecConfig(drafter="suffix", num_draft_tokens=3, tree_width=2, selector="always")):
        eng = RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, eos_token_ids=[2], spec=spec,
                            compile_mode="auto")
        for _ in range(2):  # the second call's suffix index holds the first call's outputs: drafts get accepted
            out = [r.completion_ids for r in eng.generate(prompts, params)]
        outputs.append(out)
        engines.append(eng)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    for eng in engines:
        counts = eng.runner.steps.counts
        assert counts["fused"] > 0 and counts["compiled"] == counts["eager"] == 0, counts
    assert all(eng.stats().get("rollout/accept_len", 1.0) > 1.0 for eng in engines[1:])


def test_models_the_op_does_not_cover_keep_the_compiled_step(monkeypatch):
    """q/k norms (Qwen3), float32, or the switch off (read at each step): no fused steps, the compiled ones as
    before."""
    from rlspec.rollout.runtime.runner import ModelRunner

    qwen3 = loader.from_hf_model(make_tiny_hf("qwen3", head_dim=32), torch.bfloat16, "cpu")
    llama32 = loader.from_hf_model(make_tiny_hf("llama", **HEAD32), torch.float32, "cpu")
    for model, dtype in ((qwen3, torch.bfloat16), (llama32, torch.float32)):
        runner = ModelRunner(model, "cpu", dtype, compile_mode="on")
        runner.ensure_cache(2, 32)
        assert not fused.usable(model) and runner.steps.fused is None
    monkeypatch.setattr(fused, "enabled", False)
    runner, lens = _runner(rows=2, length=32, n_prompts=1, dtype=torch.bfloat16, compile_mode="on", **HEAD32)
    runner.step(_tokens(1, 1), lens[:1])
    assert runner.steps.fused is not None and runner.steps.counts == {"fused": 0, "compiled": 1, "eager": 0}


def test_fused_steps_follow_a_weight_sync():
    """The fused op reads the blocked copies and the norm weights it gathered when its runner was built; a sync
    rewrites them in place: after load_weights the engine samples what an engine built on the new weights samples
    (with norm weights that differ, so a stale norm would show)."""
    old, new = _tiny_hf(), make_tiny_hf("llama", seed=1, **HEAD32)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name) + 1))
    prompts, params = random_prompts(3, 4, 9, seed=5), SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

    def engine(hf):
        return RolloutEngine(loader.from_hf_model(hf, torch.bfloat16), None, compile_mode="auto", eos_token_ids=[2])

    synced, fresh = engine(old), engine(new)
    before = [r.completion_ids for r in synced.generate(prompts, params)]
    synced.load_weights(new.state_dict().items())
    after = [r.completion_ids for r in synced.generate(prompts, params)]
    assert after == [r.completion_ids for r in fresh.generate(prompts, params)] and after != before
    assert synced.runner.steps.counts["fused"] > 0 and synced.runner.steps.counts["compiled"] == 0
