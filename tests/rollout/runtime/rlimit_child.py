"""Run by test_kv_growth.py in a child process: a default-budget generate call under an RLIMIT_AS that its
rows x cap pool would pass, but its tokens fit. Prints one JSON line of what happened.

Phases, after the imports and the model (whose address space is then measured) and then the limit
(VmSize + HEADROOM_GIB):
  fixed:   a pool of rows x cap blocks (kv_memory_gb) -> must fail to allocate (the limit bites);
  default: the same call with no budget -> completes, its pool grows and stays under the limit;
  inject:  a cache told its ceiling is far away and that memory is plentiful asks for a pool the limit
           refuses -> the allocator's growth fails with MemoryError and it goes on with the pool it has;
  error:   a call that cannot fit one sequence under the limit -> ValueError naming RLIMIT_AS.
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rlspec.rollout.engine import RolloutEngine  # noqa: E402
from rlspec.rollout.runtime.kv_budget import KVBudget, _field_kb, memory_limits  # noqa: E402
from rlspec.rollout.runtime.kv_cache import PagedKVCache  # noqa: E402
from rlspec.rollout.runtime.model import loader  # noqa: E402
from rlspec.rollout.types import SamplingParams  # noqa: E402
from tests.conftest import make_tiny_hf, random_prompts  # noqa: E402

HEADROOM_GIB = 1.5
BS = 4
NEW = 300_000  # the cap: 32 rows x 300k positions x 512 bytes = 4.9 GB of pool at rows x cap (K alone > the limit)
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny Llama: 2 layers, K and V, 2 KV heads x 16, float32


def engine(hf, **kv):
    return RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], kv_block_size=BS,
                         max_model_len=NEW + 64, **kv)


def main() -> None:
    torch.set_num_threads(1)
    hf = make_tiny_hf("llama", seed=7)
    prompts = random_prompts(8, 3, 12, seed=7)
    # a wide stop set: completions of a few tokens, so the call's tokens are a sliver of rows x cap
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, n=4, seed=0, stop_token_ids=list(range(3, 70)))
    rows = len(prompts) * params.n
    cap_bytes = rows * -(-(max(map(len, prompts)) + NEW + 2) // BS) * BLOCK_BYTES
    fixed, default = engine(hf, kv_memory_gb=cap_bytes / 2**30), engine(hf)
    vm = _field_kb("/proc/self/status", "VmSize")
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(HEADROOM_GIB * 2**30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    out = {"vm_after_imports": vm, "cap_bytes": cap_bytes, "limits": memory_limits("cpu")}
    try:
        fixed.generate(prompts, params)
        out["fixed"] = "ran"
    except RuntimeError as e:
        out["fixed"] = str(e).splitlines()[0]
    results = default.generate(prompts, params)
    alloc = default.runner.cache.alloc
    out["default"] = dict(results=len(results), tokens=sum(len(r.completion_ids) for r in results),
                          pool_bytes=default.runner.cache.nbytes(), max_blocks=alloc.max_blocks,
                          growths=alloc.stats.growths, peak_used=alloc.stats.peak_used)
    out["inject"] = inject_growth_failure(default.model.cfg)
    try:
        KVBudget(block_size=BS).pool_size(BLOCK_BYTES, 1, 10**9, 10**9, "cpu")
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    print(json.dumps(out))


def inject_growth_failure(cfg) -> dict:
    """A real refusal: the cache believes it may take 1 PiB, the address-space limit says otherwise."""
    cache = PagedKVCache(cfg, 1, 64, 8, BS, torch.float32, "cpu")
    cache.set_ceiling(10**8, headroom=lambda: 1 << 50)
    cache.grow([(0, "a", 20)])
    before = cache.k[:, cache.alloc.held("a")].clone()
    free = cache.alloc.reserve(10**7)  # ~20 GB of blocks
    return dict(free=free, num_blocks=cache.alloc.num_blocks, room=cache.alloc.room, error=cache.alloc.grow_error,
                k_blocks=cache.k.shape[1], kept=bool(torch.equal(cache.k[:, cache.alloc.held("a")], before)))


if __name__ == "__main__":
    main()
