"""The vLLM backend's memory settings (rollout/vllm_backend/backend.py `_memory_args`), arithmetic only: no vLLM.

With rollout.kv_memory_gb set on a GPU, vLLM's own gpu_memory_utilization (0.9) made it refuse to start beside a
trainer (its start-up check wants 0.9 x the device free); the share now follows the stated budget."""
from __future__ import annotations

import pytest

from rlspec.rollout.vllm_backend.backend import RUNTIME_HEADROOM_GB, _memory_args, budget_share

GIB = 2**30
H100 = 80 * GIB


def args(kv_gb, on_cpu=False, weights=15 * GIB, free=50 * GIB, share=None):
    return _memory_args(None, "bfloat16", on_cpu, kv_gb, share, 64, 2048, weights, (free, H100))


def test_a_stated_kv_budget_sets_the_share_vllm_checks_at_start():
    """7B policy (15 GiB) + 20 GiB of KV + the headroom, on an 80 GiB GPU where the trainer left 50 free."""
    got = args(20)
    assert got["kv_cache_memory_bytes"] == 20 * GIB
    need = (15 + 20 + RUNTIME_HEADROOM_GB) / 80
    assert need <= got["gpu_memory_utilization"] < need + 0.01
    # vLLM's start-up check: free >= share x total, which its default 0.9 fails beside the trainer
    assert got["gpu_memory_utilization"] * H100 <= 50 * GIB


def test_the_share_never_asks_more_than_is_free():
    """Rounding up to a percent must not cross the free memory (vLLM would refuse by a hair)."""
    free = 15 * GIB + 20 * GIB + int(RUNTIME_HEADROOM_GB * GIB) + 1
    share = budget_share(20 * GIB, 15 * GIB, free, H100)
    assert share * H100 <= free


def test_a_budget_that_cannot_fit_says_what_to_change():
    with pytest.raises(ValueError, match=r"kv_memory_gb=40.0 does not fit.*Lower rollout.kv_memory_gb"):
        args(40, free=30 * GIB)


def test_cpu_and_unstated_budgets_are_unchanged():
    assert args(2, on_cpu=True) == {"kv_cache_memory_bytes": 2 * GIB}
    assert args(None, share=0.5) == {"gpu_memory_utilization": 0.5}
    assert args(None) == {"gpu_memory_utilization": 0.3}
