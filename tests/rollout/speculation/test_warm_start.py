"""Drafter warm start: the cache key follows the target's weights and the drafter config, and a second
run with the same target loads the cached drafter instead of training."""
import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.drafters.eagle3_io import load_eagle3
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.speculation.training.warm_start import cache_dir, cache_key, sample_positions, warm_start, weights_fingerprint
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

# the tiny target has 2 layers: the drafter's three feature layers are all HF index 1
pytestmark = pytest.mark.filterwarnings("ignore:aux_layer_ids .* repeat a layer")


def engine(hf, online=False, **kw):
    spec = SpecConfig(drafter="eagle3", selector="always", num_draft_tokens=3, online_training=online,
                      draft_vocab_size=48)
    return RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], **kw)


def test_cache_key_follows_weights_config_and_tag():
    hf = make_tiny_hf("llama", seed=3)
    target = loader.from_hf_model(hf)
    cfg = Eagle3Config.for_target(target.cfg, 48)
    key = cache_key(target, cfg)
    assert key == cache_key(loader.from_hf_model(hf), cfg)  # same weights, another load: same key
    assert len(key) == 24
    assert cache_key(target, Eagle3Config.for_target(target.cfg, 32)) != key  # drafter config
    assert cache_key(target, cfg, tag="gsm8k") != key
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight.add_(1e-3)  # a small RL-sized update of one tensor
    assert cache_key(target, cfg) != key
    # sampled and exact fingerprints both see it; bf16 weights hash too
    exact = weights_fingerprint(target, sample=None)
    assert exact != weights_fingerprint(loader.from_hf_model(hf), sample=None)
    assert weights_fingerprint(target.to(torch.bfloat16), sample=None) != exact  # .to() converts in place


def test_fingerprint_positions_stay_inside_large_tensors():
    """SmolLM2's embedding has 28,311,552 elements: a float32 linspace put its last index out of range."""
    for n in (28_311_552, 2**24 + 1, 70_000, 65_537):
        idx = sample_positions(n, 1 << 16)
        assert idx[0] == 0 and idx[-1] == n - 1 and len(idx) == 1 << 16
        assert bool((idx[1:] > idx[:-1]).all())


def test_cache_dir_honours_rlspec_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLSPEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "drafters"
    assert cache_dir(tmp_path / "x") == tmp_path / "x" / "drafters"


def test_warm_start_trains_saves_then_loads(tmp_path):
    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(6, 4, 10, seed=4)
    eng = engine(hf)
    res = warm_start(eng, prompts, budget_s=None, max_steps=6, group=2, prompts_per_round=6, steps_per_round=6,
                     max_new_tokens=24, root=tmp_path, use_tqdm=False, min_tokens=16, batch=4, window=16)
    assert not res.cached and res.steps == 6 and res.tokens > 0
    assert (tmp_path / "drafters" / res.key / "config.json").is_file()
    saved = load_eagle3(res.path)
    # no online training follows: the warm-up's trainer is gone, its weights are in the drafter, and
    # rollouts stage no training data (no target top-k per verified token)
    drafter = eng.speculation.learned
    assert eng.speculation.trainer is None and drafter.trainer is None and drafter.version >= 1
    assert torch.equal(saved.d2t, drafter.model.d2t)  # the chosen draft vocabulary went with it
    for name, t in saved.state_dict().items():  # the export is stored in bfloat16: compare at its precision
        assert torch.equal(drafter.model.state_dict()[name].to(torch.bfloat16).to(t.dtype), t), name
    eng.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    assert set(eng.runner.cache.side) == {"eagle3/features"}

    # a later run of the same target: loads, trains nothing, drafts with the saved weights
    eng2 = engine(hf)
    res2 = warm_start(eng2, prompts, budget_s=1.0, root=tmp_path, use_tqdm=False)
    assert res2.cached and res2.key == res.key and res2.steps == 0
    for name, t in saved.state_dict().items():
        assert torch.equal(eng2.speculation.learned.model.state_dict()[name].float(), t.float()), name

    # a changed target misses the cache
    with torch.no_grad():
        hf.model.layers[1].self_attn.o_proj.weight.mul_(1.01)
    res3 = warm_start(engine(hf), prompts, budget_s=None, max_steps=1, group=1, max_new_tokens=8, root=tmp_path,
                      use_tqdm=False, min_tokens=1, batch=2, window=8)
    assert not res3.cached and res3.key != res.key


def test_cached_drafter_reaches_an_online_trainer_and_stays_exact(tmp_path):
    hf = make_tiny_hf("llama", seed=5)
    prompts = random_prompts(4, 4, 10, seed=5)
    res = warm_start(engine(hf), prompts, budget_s=None, max_steps=4, group=2, max_new_tokens=16, root=tmp_path,
                     use_tqdm=False, min_tokens=16, batch=4, window=16)
    eng = engine(hf, online=True)  # a background trainer of its own
    try:
        trainer = eng.speculation.trainer
        assert warm_start(eng, prompts, max_steps=10, root=tmp_path, use_tqdm=False).cached
        saved = load_eagle3(res.path)
        assert torch.equal(trainer.model.d2t, saved.d2t)
        params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        eng.speculation.force(Arm("eagle3", 3, 1))
        out = [r.completion_ids for r in eng.generate(prompts, params)]
        assert torch.equal(eng.speculation.learned.model.d2t, saved.d2t)  # swapped in at the first proposal
        trainer.train_steps(2)  # online training goes on from the loaded vocabulary, not a new one
        assert torch.equal(trainer.model.d2t, saved.d2t)
        plain = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2])
        assert out == [r.completion_ids for r in plain.generate(prompts, params)]
    finally:
        eng.speculation.close()


def test_warm_start_needs_a_budget_and_a_learned_drafter(tmp_path):
    hf = make_tiny_hf("llama", seed=6)
    with pytest.raises(ValueError, match="budget"):
        warm_start(engine(hf), [[3, 4]], budget_s=None, max_steps=None, root=tmp_path)
    plain = RolloutEngine(loader.from_hf_model(hf), None, spec=SpecConfig(drafter="suffix"), eos_token_ids=[2])
    with pytest.raises(ValueError, match="learned drafter"):
        warm_start(plain, [[3, 4]], root=tmp_path)


def test_warm_start_trains_through_an_out_of_process_trainer(tmp_path):
    """The engine's own online trainer in its child process does the warm-up and the export."""
    hf = make_tiny_hf("llama", seed=7)
    prompts = random_prompts(8, 4, 10, seed=7)
    eng = engine(hf, online=True)
    try:
        from rlspec.rollout.speculation.training.trainer_process import ProcessTrainer

        assert isinstance(eng.speculation.trainer, ProcessTrainer)  # CPU + "auto": a process
        initial = {k: v.clone() for k, v in eng.speculation.learned.model.state_dict().items()}
        # the child's trainer waits for 1024 buffered positions: rounds collect until it has them
        res = warm_start(eng, prompts, budget_s=None, max_steps=3, group=4, max_new_tokens=48, root=tmp_path,
                         use_tqdm=False)
        # >= : the child also trains on its own whenever the engine reports idle compute
        assert not res.cached and res.steps >= 3 and res.tokens >= 1024
        saved = load_eagle3(res.path)  # the child's trained weights, its chosen draft vocabulary with them
        assert not torch.equal(saved.fc.weight.float(), initial["fc.weight"].float())
        assert torch.equal(saved.d2t, eng.speculation.trainer.model.d2t)
        assert not torch.equal(saved.d2t, initial["d2t"])
    finally:
        eng.close()
