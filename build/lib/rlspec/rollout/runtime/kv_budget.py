"""How many KV blocks the pool gets: from a memory budget, or by default from the tokens a call holds.

Order of precedence (`KVBudget.pool_size`):
  1. `memory_gb`: that many GiB of K and V (all layers, the drafter's included): a fixed pool;
  2. `memory_fraction`: that share of the device's free memory when the pool is allocated (CUDA:
     torch.cuda.mem_get_info; CPU: MemAvailable): a fixed pool;
  3. neither (the default): memory follows tokens. The pool starts at what the call needs to begin
     (one sequence of its longest length, a block per row, or the previous call's peak; rounded up
     to a power of two, as every growth is: on CUDA each pool size is a FlexAttention compile) and grows
     in place when the scheduler runs short (blocks.BlockAllocator.reserve), before anything is
     preempted, up to a ceiling: rows x length worth of blocks (more could never be used), but at most
     DEFAULT_FRACTION of what the process may still use (`memory_limits`: RLIMIT_AS headroom, the
     memory cgroup's headroom and MemAvailable on a CPU; free device memory on CUDA). Past the
     ceiling the youngest sequences are preempted, as under a fixed budget.
On CUDA a growing pool keeps a reserve back from that share (`step_reserve_bytes`, passed as reserve_bytes): the
CUDA graphs captured after it (static buffers and their private pool), the verify's [B, K+1, V] float32 logits
and the copies verification makes of them, and what the online drafter trainer will allocate (its optimizer
state and activations, DrafterTrainer.memory_bytes); without it the pool could take 90% of free memory and
leave the captures, the verify and the drafter trainer to run out of memory later (docs/runtime.md#memory-plan).
The pool is never larger than rows x length worth of blocks, and it must be able to hold one sequence
of the call's longest need; a budget (or ceiling) below that is an error that names the size required.
The pool is zero-filled (torch.zeros touches every page, also on a CPU): garbage in never-written
positions could be NaN, and a masked key's value still meets a zero weight.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rlspec.rollout.runtime.blocks import pow2_at_least

DEFAULT_BLOCK_SIZE = 16  # positions per block: vLLM's default; waste is < 16 positions per sequence
DEFAULT_FRACTION = 0.9  # of what the process may still use, when no budget is given
VERIFY_COPIES = 3  # [B, K+1, V] float32 tensors a verify holds at once: the logits, the processed law, its softmax
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2**63 rounded down to a page: anything above is none


@dataclass(frozen=True)
class PoolSize:
    blocks: int  # to allocate now (the trash block included)
    max_blocks: int  # the most the pool may grow to (== blocks: a fixed pool)


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

    @property
    def grows(self) -> bool:
        """No budget given: the pool follows the call's tokens."""
        return self.memory_gb is None and self.memory_fraction is None

    def pool_blocks(self, block_bytes: int, rows: int, length: int, min_positions: int, device) -> int:
        """The most blocks the pool may have (the trash block included); see pool_size."""
        return self.pool_size(block_bytes, rows, length, min_positions, device).max_blocks

    def pool_size(self, block_bytes: int, rows: int, length: int, min_positions: int, device,
                  start_blocks: int = 0, held_bytes: int = 0, reserve_bytes: int = 0) -> PoolSize:
        """The pool for `rows` table rows of `length` positions. min_positions: the longest single sequence
        the call needs (prompt + completion); start_blocks: a hint for a growing pool's start (the previous
        call's peak); held_bytes: memory of a pool this one replaces or keeps, usable again; reserve_bytes: what a
        growing pool leaves for others (step_reserve_bytes)."""
        cap = rows * -(-length // self.block_size)
        if self.memory_gb is not None:
            blocks = int(self.memory_gb * 2**30 // block_bytes)
        elif self.memory_fraction is not None:
            blocks = int(self.memory_fraction * free_memory_bytes(device) // block_bytes)
        else:
            blocks = int((max(0, self.headroom(device) - reserve_bytes) + held_bytes) // block_bytes)
        need = -(-min_positions // self.block_size)
        if blocks < need:
            raise ValueError(self._too_small(blocks, need, block_bytes, min_positions, device))
        ceiling = min(blocks, cap) + 1  # + the trash block
        if not self.grows:
            return PoolSize(ceiling, ceiling)
        return PoolSize(min(ceiling, pow2_at_least(max(need, rows, start_blocks) + 1)), ceiling)

    def headroom(self, device) -> int:
        """Bytes a growing pool may still take: DEFAULT_FRACTION of the tightest memory limit (the ceiling
        callbacks take a reserve off it: `ceiling_headroom`)."""
        return int(DEFAULT_FRACTION * min(memory_limits(device).values()))

    def ceiling_headroom(self, device, reserve_bytes: int = 0):
        """headroom() less the reserve: the callback a growing pool asks before each growth (kv_cache.set_ceiling)."""
        return lambda: max(0, self.headroom(device) - reserve_bytes)

    def _too_small(self, blocks: int, need: int, block_bytes: int, min_positions: int, device) -> str:
        gib = 2**30
        limits = ", ".join(f"{k} {v / gib:.3f} GiB" for k, v in memory_limits(device).items())
        what = "the KV budget" if not self.grows else \
            f"the memory this process may still use ({limits}; {DEFAULT_FRACTION:.0%} of the least)"
        return (f"{what} holds {blocks} blocks of {self.block_size} positions ({blocks * block_bytes / gib:.3f} GiB), "
                f"but one sequence of {min_positions} positions needs {need} blocks = {need * block_bytes / gib:.3f} "
                "GiB; raise rollout.kv_memory_gb / kv_memory_fraction (engine: kv_memory_gb=, kv_memory_fraction=) "
                "or the process's memory limits, or lower max_new_tokens")


def step_reserve_bytes(cfg, rows: int, max_t: int, dtype: torch.dtype, hidden_layers: int = 3) -> int:
    """Bytes a step needs beside the KV pool at `rows` rows of `max_t` tokens (the largest verify, K+1): the
    graphs' static buffers (logits [rows, t, V] float32, the EAGLE-3 feature outputs [rows, t, H] per hidden
    layer), their private pool (a capture's activations: the logits again, the MLP's [rows, t, 2I] and the
    attention's [rows, t, 4H]) and the verify's VERIFY_COPIES float32 [rows, t, V] tensors."""
    n, elt = rows * max_t, torch.empty(0, dtype=dtype).element_size()
    logits = n * cfg.vocab_size * 4
    static = logits + n * cfg.hidden_size * elt * hidden_layers
    activations = logits + n * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * elt
    return static + activations + VERIFY_COPIES * logits


# ---- what the process may use -------------------------------------------------------------------------
def memory_limits(device) -> dict[str, int]:
    """Bytes the process may still allocate where the pool lives, by limit (only the limits that are set).
    CUDA: the device's free memory. CPU: MemAvailable, RLIMIT_AS headroom, the memory cgroup's headroom."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"free device memory": torch.cuda.mem_get_info(device)[0]}
    out = {"MemAvailable": free_memory_bytes(device)}
    for name, value in (("RLIMIT_AS headroom", address_space_headroom()), ("cgroup headroom", cgroup_headroom())):
        if value is not None:
            out[name] = value
    return out


def total_memory_bytes(device) -> int:
    """The device's whole memory: the CUDA device's, or the host's RAM (MemTotal)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    got = _field_kb("/proc/meminfo", "MemTotal")
    return got if got is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device) -> int:
    """Free memory where the pool will live: the CUDA device's, or the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    got = _field_kb("/proc/meminfo", "MemAvailable")
    return got if got is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def address_space_headroom(limit: int | None = None, status_path: str = "/proc/self/status") -> int | None:
    """RLIMIT_AS (soft; `limit` overrides it) minus the address space mapped now (VmSize): what a new
    mapping may still take; None when no limit is set or VmSize cannot be read. Every mapping counts
    (thread stacks, allocator arenas, a torch import's reservations), not only touched memory."""
    if limit is None:
        try:
            import resource
        except ImportError:  # not a Unix
            return None
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
    if limit < 0:
        return None
    size = _field_kb(status_path, "VmSize")
    return None if size is None else max(0, limit - size)


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What the process's memory cgroup lets it still charge: the least limit - usage over its cgroup and
    every ancestor (a parent's limit covers its children's usage). cgroup v2 (memory.max, memory.current)
    and v1 (memory.limit_in_bytes, memory.usage_in_bytes); None when no limit is set or none is mounted."""
    best = None
    for folder, limit_name, usage_name in _cgroup_folders(proc_cgroup, Path(root)):
        limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
        if limit is None or usage is None or limit >= NO_LIMIT:
            continue
        best = max(0, limit - usage) if best is None else min(best, max(0, limit - usage))
    return best


def _cgroup_folders(proc_cgroup: str, root: Path):
    """(folder, limit file, usage file) from the process's memory cgroup up to the hierarchy's mount. A
    cgroup path that does not exist here (a container sees its own cgroup as the mount) falls back to it."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, rel = parts
        if hier == "0" and controllers == "":
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        leaf = base / rel.lstrip("/")
        folder = leaf if leaf.is_dir() else base
        while True:
            yield (folder, *files)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent


def _read_int(path: Path) -> int | None:
    """An integer file ("max" in cgroup v2 means no limit: None)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _field_kb(path: str, field: str) -> int | None:
    """A "Field:   123 kB" line of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
