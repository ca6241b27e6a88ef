"""Default KV memory follows tokens: the pool starts small and grows in place (blocks.BlockAllocator.reserve,
kv_cache.PagedKVCache._grow_pool) up to a ceiling bounded by what the process may use (kv_budget.memory_limits:
RLIMIT_AS, the memory cgroup, MemAvailable); growth never changes a sampled token; a growth the memory
refuses leaves the pool as it was and the engine preempts instead."""
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.blocks import BlockAllocator, pow2_at_least
from rlspec.rollout.runtime.graphs import EagerRunner, GraphPool
from rlspec.rollout.runtime.kv_budget import (DEFAULT_FRACTION, NO_LIMIT, KVBudget, address_space_headroom,
                                       cgroup_headroom, memory_limits)
from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.runtime.model.config import ModelConfig
from rlspec.rollout.runtime.runner import ModelRunner
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import TINY_VOCAB, make_tiny_hf, random_prompts
from tests.rollout.test_engine_ar import hf_greedy

BS = 4
HERE = Path(__file__).resolve().parent


# ---- the allocator ---------------------------------------------------------------------------------
def _replay(alloc: BlockAllocator, seed: int) -> list:
    """Random ensure / trim / free_owner / share traffic through `alloc` (reserving first, as the scheduler
    does); returns every owner's blocks after every operation."""
    rng, owners, trace = random.Random(seed), {}, []
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not owners:
            name, n = f"s{step}" if rng.random() < 0.3 or not owners else rng.choice(list(owners)), rng.randint(1, 40)
            if alloc.reserve(alloc.needed(name, n)) >= alloc.needed(name, n):
                alloc.ensure(name, n)
                owners[name] = n
        elif op < 0.7:
            name = rng.choice(list(owners))
            owners[name] = rng.randint(0, owners[name])
            alloc.trim(name, owners[name])
        elif op < 0.9:
            name = rng.choice(list(owners))
            del owners[name]
            alloc.free_owner(name)
        else:
            src = rng.choice(list(owners))
            if len(alloc.held(src)) >= 2:
                alloc.share(src, f"c{step}", 2)
                owners[f"c{step}"] = 2 * alloc.block_size
        trace.append({o: list(alloc.held(o)) for o in owners})
    return trace


def _growing(start: int, ceiling: int) -> BlockAllocator:
    return BlockAllocator(start, BS, ceiling, grow_pool=lambda target: target)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_growing_allocator_hands_out_the_blocks_of_one_allocated_at_its_ceiling(seed):
    fixed, growing = BlockAllocator(120, BS), _growing(3, 120)
    assert growing.room == fixed.free == 119 and growing.free == 2
    assert _replay(growing, seed) == _replay(fixed, seed)
    assert growing.stats.growths >= 3 and growing.num_blocks <= 120


def test_reserve_grows_by_at_least_doubling_to_powers_of_two_and_never_past_the_ceiling():
    a = _growing(5, 100)
    assert a.reserve(3) == 4 and a.num_blocks == 5, "enough free: no growth"
    assert a.reserve(6) == 15 and a.num_blocks == 16, "short by 2: doubled, up to a power of two"
    assert a.reserve(50) == 63 and a.num_blocks == 64, "short by 35: that much, up to a power of two"
    assert a.reserve(200) == 99 and a.num_blocks == 100 and a.room == 99, "capped at the ceiling"
    assert a.stats.growths == 3 and a.free_list[-1] == 1, "the original blocks are still handed out first"


def test_a_failed_growth_freezes_the_pool_and_says_why():
    def refuse(target):
        raise MemoryError("no more memory")

    a = BlockAllocator(4, BS, 100, grow_pool=refuse)
    a.ensure("x", 8)
    assert a.room == 99 - 2
    assert a.reserve(10) == 1 and a.max_blocks == 4 and a.room == 1 and "no more memory" in a.grow_error
    with pytest.raises(Exception, match="could not grow: no more memory"):
        a.ensure("y", 20)


def test_fresh_keeps_the_size_ceiling_and_growth():
    a = _growing(4, 40)
    a.ensure("x", 40)
    b = a.fresh()
    assert (b.num_blocks, b.max_blocks, b.free, b.grow_pool) == (a.num_blocks, 40, a.num_blocks - 1, a.grow_pool)


# ---- the cache ------------------------------------------------------------------------------------------
def _cfg():
    return ModelConfig.from_hf(make_tiny_hf("llama").config)


def test_growth_copies_every_block_keeps_the_table_and_bumps_the_generation():
    side = {"feat": ((3,), torch.float32)}
    cache = PagedKVCache(_cfg(), 2, 64, 6, BS, torch.float32, "cpu", extra_layers=1, side=side)
    cache.set_ceiling(40)
    cache.grow([(0, "a", 12), (1, "b", 8)])
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_(), cache.side["feat"].normal_()
    k, v, f, table = cache.k.clone(), cache.v.clone(), cache.side["feat"].clone(), cache.table.clone()
    cache.grow([(0, "a", 30)])  # 5 more blocks, 0 free: at least 11 (6 + 5), doubled to 12, up to 16
    assert cache.k.shape[1] == cache.v.shape[1] == cache.side["feat"].shape[0] == cache.alloc.num_blocks == 16
    assert torch.equal(cache.k[:, :6], k) and torch.equal(cache.v[:, :6], v) and torch.equal(cache.side["feat"][:6], f)
    assert cache.k[:, 6:].eq(0).all() and torch.equal(cache.table[1], table[1]) and cache.generation == 1
    assert cache.table[0, :8].tolist() == cache.alloc.held("a") and max(cache.alloc.held("a")) >= 6
    assert cache.block_nbytes() * 16 == cache.nbytes()


def test_growth_is_clamped_by_the_headroom_and_refused_without_it():
    cache = PagedKVCache(_cfg(), 1, 256, 4, BS, torch.float32, "cpu")
    room = [cache.block_nbytes() * 7]
    cache.set_ceiling(60, headroom=lambda: room[0])
    assert cache.alloc.reserve(20) == 6 and cache.alloc.num_blocks == 7, "the new pool must fit beside the old one"
    room[0] = 0
    assert cache.alloc.reserve(20) == 6 and cache.alloc.room == 6 and "memory limits" in cache.alloc.grow_error


def test_a_fixed_pool_never_grows():
    cache = PagedKVCache(_cfg(), 1, 64, 4, BS, torch.float32, "cpu")
    cache.set_ceiling(4)
    assert cache.alloc.grow_pool is None and cache.alloc.reserve(10) == 3


def test_graphs_over_a_grown_pool_are_dropped_and_captured_again():
    model = loader.from_hf_model(make_tiny_hf("llama"), torch.float32, "cpu")
    runner = ModelRunner(model, "cpu", torch.float32)
    cache = runner.ensure_cache(4, 64)
    prompts = random_prompts(4, 3, 12, seed=3)
    cache.grow([(r, r, len(p) + 1) for r, p in enumerate(prompts)])
    runner.prefill(prompts, list(range(4)))
    pool = GraphPool(model, cache, "cpu", max_t=2, backend="emulate")
    eager = EagerRunner(model, cache, "cpu")
    start = torch.tensor([len(p) for p in prompts])
    tokens = torch.randint(3, TINY_VOCAB, (4, 1), generator=torch.Generator().manual_seed(0))
    pool.run(tokens, start)
    blocks = cache.alloc.num_blocks
    cache.grow([(r, r, 64) for r in range(4)])  # every row's whole width: the pool grows to its ceiling
    assert cache.alloc.num_blocks > blocks and cache.alloc.num_blocks == cache.alloc.max_blocks
    assert cache.generation >= 1  # (each owner reserves for itself here: maybe twice)
    got, _ = pool.run(tokens, start)
    ref, _ = eager.run(tokens, start)
    assert pool.drops == 1 and pool.counts["captures"] == 2 and torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_a_flex_pool_counts_its_budget_in_its_own_128_position_blocks(monkeypatch):
    """CUDA's pool (paged FlexAttention) has 128-position blocks whatever the budget's block size: a budget
    of 6 such blocks holds a 209-position sequence (2 blocks). Counted in 16-position blocks it asked for
    14 and refused (found by `make gpu-check`); on a CPU the dispatch is forced to flex's pool here."""
    import rlspec.rollout.runtime.runner as runner_mod
    from rlspec.rollout.runtime.kv_cache import block_bytes
    from rlspec.rollout.runtime.model.attention import BLOCK

    model = loader.from_hf_model(make_tiny_hf("llama"), torch.float32, "cpu")
    budget = KVBudget(memory_gb=6 * block_bytes(model.cfg, 2, BLOCK, torch.float32) / 2**30)
    runner = ModelRunner(model, "cpu", torch.float32, budget=budget)
    monkeypatch.setattr(runner_mod, "use_flex", lambda device: True)
    cache = runner.ensure_cache(16, 256, min_positions=209)
    assert cache.block_size == BLOCK and cache.alloc.capacity * BLOCK >= 209
    assert runner.ensure_cache(16, 256, min_positions=250) is cache  # and the kept pool refits in its blocks


# ---- the engine ---------------------------------------------------------------------------------------
def _engine(hf, spec=None, **kw):
    return RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], kv_block_size=BS, **kw)


EAGLE = SpecConfig(drafter="eagle3", num_draft_tokens=3, tree_width=1, selector="always", online_training=False)


@pytest.mark.parametrize("spec", [None, EAGLE], ids=["plain", "eagle3"])
def test_default_pool_starts_small_grows_and_samples_what_a_presized_pool_does(spec, monkeypatch):
    hf = make_tiny_hf("llama", seed=4)
    prompts = random_prompts(8, 3, 12, seed=4)
    # one stop token in a vocabulary of 96: completions of ~35 tokens against a cap of 96, so the pool grows
    # at admission and again mid-decode, and stays well below rows x cap
    params = SamplingParams(temperature=1.0, max_new_tokens=96, n=2, seed=3, stop_token_ids=[3])
    grown_at = []  # decode steps run when the pool grew: growth must happen mid-decode too
    real = PagedKVCache._grow_pool
    eng = _engine(hf, spec)
    monkeypatch.setattr(PagedKVCache, "_grow_pool",
                        lambda self, t: grown_at.append(len(eng.batch_trace)) or real(self, t))
    got = [(r.completion_ids, r.logprobs) for r in eng.generate(prompts, params)]
    cache = eng.runner.cache
    presized = _engine(hf, spec, kv_memory_gb=1.0)
    ref = [(r.completion_ids, r.logprobs) for r in presized.generate(prompts, params)]
    rows_x_cap = presized.runner.cache.alloc.capacity
    assert rows_x_cap == cache.rows * (cache.length // BS), "the pre-sized pool is rows x length"
    assert cache.alloc.capacity < rows_x_cap / 2 and cache.alloc.stats.growths >= 2
    assert max(grown_at) > 0, "no growth during decoding"
    assert got == ref, "growth changed a sampled token"
    assert eng.stats()["rollout/preemptions"] == 0


def test_growth_refused_midway_falls_back_to_preemption(monkeypatch):
    """The process runs out of memory after the first growth: the pool stays as it is, the youngest are
    preempted, and greedy decoding is unchanged."""
    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(6, 2, 25, seed=3)
    headroom = itertools.chain([1 << 40] * 2, itertools.repeat(0))  # the ceiling, one growth, then nothing
    monkeypatch.setattr(KVBudget, "headroom", lambda self, device: next(headroom))
    eng = _engine(hf)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, n=2))
    alloc = eng.runner.cache.alloc
    assert alloc.stats.growths == 1 and alloc.max_blocks == alloc.num_blocks and "memory limits" in alloc.grow_error
    assert eng.stats()["rollout/preemptions"] > 0
    for i, r in enumerate(got):
        ref = hf_greedy(hf, prompts[i // 2], 24, eos=2)
        assert r.completion_ids == (ref[: ref.index(2) + 1] if 2 in ref else ref)


def test_a_kept_pool_takes_each_calls_ceiling_and_a_released_one_starts_at_the_last_peak():
    hf = make_tiny_hf("llama", seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=16, n=4)
    prompts = random_prompts(4, 3, 9, seed=5)
    eng = _engine(hf)
    eng.generate(prompts, params)
    cache = eng.runner.cache
    first_max = cache.alloc.max_blocks
    eng.generate(prompts[:2], params)  # fewer rows: the same pool, which keeps its size
    assert eng.runner.cache is cache and cache.alloc.max_blocks == first_max >= cache.alloc.num_blocks
    peak = cache.alloc.stats.peak_used
    eng.release_kv()
    assert eng.runner.kv_peak_blocks == peak > 8
    fresh = eng.runner.ensure_cache(8, 32, min_positions=10)
    assert fresh is not cache and fresh.alloc.num_blocks == pow2_at_least(peak + 1) < fresh.alloc.max_blocks


def test_under_an_address_space_limit_the_default_call_runs_where_rows_x_cap_cannot():
    """A child process under RLIMIT_AS = VmSize + 1.5 GiB: a rows x cap pool (4.9 GB) fails to allocate; the
    default pool runs the same call; a real refused growth leaves the pool usable; a call that cannot fit
    one sequence says RLIMIT_AS is what bounds it."""
    proc = subprocess.run([sys.executable, str(HERE / "rlimit_child.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    limit = 1.5 * 2**30
    assert "can't allocate memory" in out["fixed"], out["fixed"]
    assert out["cap_bytes"] > 2 * limit
    assert 0 < out["limits"]["RLIMIT_AS headroom"] <= limit
    d = out["default"]
    assert d["results"] == 32 and d["pool_bytes"] < DEFAULT_FRACTION * limit
    assert (d["max_blocks"] - 1) * 2048 <= DEFAULT_FRACTION * limit, "the ceiling respects RLIMIT_AS"
    inj = out["inject"]
    assert "can't allocate memory" in inj["error"] and inj["num_blocks"] == inj["k_blocks"] == 8 and inj["kept"]
    assert inj["room"] == inj["free"]
    assert "RLIMIT_AS headroom" in out["error"] and "needs 250000000 blocks" in out["error"]


def test_kv_growth_bench_smoke_run_on_the_embedded_model(smollm2_dir, tmp_path):
    """`python -m rlspec.bench kv --part growth` (the 256-sequence, cap-4096 check under RLIMIT_AS) at a smoke
    size, in a process of its own: the limit covers the whole process."""
    out = tmp_path / "kv_growth.json"
    proc = subprocess.run([sys.executable, "-m", "rlspec.bench", "kv", "--part", "growth", "--smoke", "--out", str(out)],
                          cwd=HERE.parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["tokens"] > 0 and 0 < report["vm_after_model_gib"] < report["args"]["limit_gb"]
    assert "RLIMIT_AS headroom" in report["limits_gib"] and report["pool_blocks"] <= report["ceiling_blocks"]


# ---- what the process may use: parsing -----------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_rlimit_headroom_is_the_limit_minus_vmsize(tmp_path):
    status = tmp_path / "status"
    _write(status, "Name:\tpython\nVmPeak:\t 9000 kB\nVmSize:\t    4096 kB\nVmRSS:\t 100 kB\n")
    assert address_space_headroom(10 * 2**20, str(status)) == 10 * 2**20 - 4096 * 1024
    assert address_space_headroom(1024, str(status)) == 0, "already past the limit: nothing left"
    assert address_space_headroom(10 * 2**20, str(tmp_path / "missing")) is None
    assert address_space_headroom(-1, str(status)) is None


def test_cgroup_v2_takes_the_least_headroom_over_the_cgroup_and_its_ancestors(tmp_path):
    _write(tmp_path / "proc", "0::/user.slice/job\n")
    root = tmp_path / "cg"
    _write(root / "user.slice/memory.max", f"{8 << 30}\n")
    _write(root / "user.slice/memory.current", f"{7 << 30}\n")
    _write(root / "user.slice/job/memory.max", "max\n")  # no limit of its own
    _write(root / "user.slice/job/memory.current", f"{1 << 30}\n")
    assert cgroup_headroom(str(tmp_path / "proc"), str(root)) == 1 << 30
    _write(root / "user.slice/job/memory.max", f"{(1 << 30) + 5}\n")
    assert cgroup_headroom(str(tmp_path / "proc"), str(root)) == 5


def test_cgroup_v1_reads_the_memory_hierarchy_and_ignores_its_no_limit_value(tmp_path):
    _write(tmp_path / "proc", "9:name=systemd:/\n4:memory:/api/abc\n3:cpuset:/\n0::/\n")
    mem = tmp_path / "cg/memory"
    _write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(mem / "memory.usage_in_bytes", "1000\n")
    _write(mem / "api/abc/memory.limit_in_bytes", "9223372036854771712\n")
    _write(mem / "api/abc/memory.usage_in_bytes", "10\n")
    assert cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "cg")) is None, "no limit anywhere"
    _write(mem / "api/memory.limit_in_bytes", "4000\n")
    _write(mem / "api/memory.usage_in_bytes", "1500\n")
    assert cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "cg")) == 2500
    assert 9223372036854771712 >= NO_LIMIT


def test_cgroup_path_missing_in_this_namespace_falls_back_to_the_mount(tmp_path):
    _write(tmp_path / "proc", "0::/docker/elsewhere\n")
    _write(tmp_path / "cg/memory.max", "3000\n")
    _write(tmp_path / "cg/memory.current", "1000\n")
    assert cgroup_headroom(str(tmp_path / "proc"), str(tmp_path / "cg")) == 2000
    assert cgroup_headroom(str(tmp_path / "nothing"), str(tmp_path / "cg")) is None
    _write(tmp_path / "proc2", "5:cpu,cpuacct:/\n")  # no memory controller at all
    assert cgroup_headroom(str(tmp_path / "proc2"), str(tmp_path / "cg")) is None


def test_budget_ceiling_follows_the_tightest_limit(monkeypatch):
    import rlspec.rollout.runtime.kv_budget as kb

    monkeypatch.setattr(kb, "address_space_headroom", lambda: 1000 * 1024)
    monkeypatch.setattr(kb, "cgroup_headroom", lambda: None)
    limits = memory_limits("cpu")
    assert limits["RLIMIT_AS headroom"] == 1000 * 1024 and "cgroup headroom" not in limits and "MemAvailable" in limits
    size = KVBudget(block_size=BS).pool_size(1024, rows=4, length=10_000, min_positions=100, device="cpu")
    assert size.max_blocks == int(DEFAULT_FRACTION * 1000) + 1
    assert size.blocks == 32, "one sequence of 100 positions (25 blocks) + the trash block, up to a power of two"
    fixed = KVBudget(memory_gb=1.0, block_size=BS).pool_size(1024, rows=4, length=64, min_positions=64, device="cpu")
    assert fixed.blocks == fixed.max_blocks == 4 * 16 + 1, "a fixed pool: rows x length at most, never grows"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_growth_mid_decode_under_cuda_graphs_and_flex_equals_a_presized_pool():
    """CUDA graphs hold the pool's addresses and FlexAttention reads the pool as one sequence: a pool that
    grows mid-decode (8 rows of up to 6 blocks of 128: 16 -> 32 at admission, -> 41 near step 380) drops
    its graphs and decodes exactly what a pool allocated at 41 blocks does."""
    from rlspec.rollout.runtime.model import attention

    hf = make_tiny_hf("llama", seed=2)
    prompts = random_prompts(4, 2, 60, seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=600, n=2)

    def run(**kv):
        eng = RolloutEngine(loader.from_hf_model(hf, torch.float32, "cuda"), None, eos_token_ids=[2],
                            max_model_len=1024, free_kv_between_rollouts=False, **kv)
        return eng, [r.completion_ids for r in eng.generate(prompts, params)]

    grown, got = run()
    _, ref = run(kv_memory_gb=1.0)
    assert attention.flex_error() is None, attention.flex_error()
    assert grown.runner.cache.alloc.stats.growths >= 2 and grown.runner.steps.drops >= 1
    assert got == ref
