"""How many KV blocks the pool gets: from a memory budget, never from rows x max length alone.

Order of precedence (`KVBudget.pool_blocks`):
  1. `memory_gb`: that many GiB of K and V (all layers, the drafter's included);
  2. `memory_fraction`: that share of the device's free memory when the pool is allocated (CUDA:
     torch.cuda.mem_get_info; CPU: MemAvailable);
  3. neither (the default): what `rows` sequences of `length` positions could ever use (today's
     contiguous size, so nothing is ever preempted), but at most DEFAULT_FRACTION of free memory,
     so an oversized request preempts instead of failing to allocate.
The pool is never larger than rows x length worth of blocks (more could never be used), and it
must hold at least one sequence of the call's longest need; a budget below that is an error that
names the size required. The pool is zero-filled (torch.zeros touches every page, also on a CPU):
garbage in never-written positions could be NaN, and a masked key's value still meets a zero weight.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 16  # positions per block: vLLM's default; waste is < 16 positions per sequence
DEFAULT_FRACTION = 0.9  # of free memory, when no budget is given and rows x length would not fit


@dataclass(frozen=True)
class KVBudget:
    memory_gb: float | None = None
    memory_fraction: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be > 0 GiB, got {self.memory_gb}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1 position, got {self.block_size}")

    def pool_blocks(self, block_bytes: int, rows: int, length: int, min_positions: int, device) -> int:
        """Blocks of the pool (the trash block included) for `rows` table rows of `length` positions.
        min_positions: the longest single sequence the call needs (prompt + completion)."""
        per_row = -(-length // self.block_size)
        cap = rows * per_row
        if self.memory_gb is not None:
            blocks = int(self.memory_gb * 2**30 // block_bytes)
        elif self.memory_fraction is not None:
            blocks = int(self.memory_fraction * free_memory_bytes(device) // block_bytes)
        else:
            blocks = min(cap, int(DEFAULT_FRACTION * free_memory_bytes(device) // block_bytes))
        need = -(-min_positions // self.block_size)
        if blocks < need:
            raise ValueError(
                f"the KV budget holds {blocks} blocks of {self.block_size} positions ({blocks * block_bytes / 2**30:.3f} "
                f"GiB), but one sequence of {min_positions} positions needs {need} blocks = "
                f"{need * block_bytes / 2**30:.3f} GiB; raise rollout.kv_memory_gb / kv_memory_fraction (engine: "
                "kv_memory_gb=, kv_memory_fraction=) or lower max_new_tokens")
        return min(blocks, cap) + 1  # + the trash block


def free_memory_bytes(device) -> int:
    """Free memory where the pool will live: the CUDA device's, or the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
