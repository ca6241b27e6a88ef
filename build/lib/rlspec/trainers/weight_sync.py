"""Policy -> engine weight sync: push the trainer's current parameters into the rollout engine.

The engine keeps its own copy of the weights (its own layout and dtype), so after every optimizer
step the trainer must hand it the new parameters before the next rollout, or the rollouts would be
sampled from a stale policy and the importance-sampling check would show it.

Under DeepSpeed ZeRO-3 every process holds only a shard of each parameter. The sync gathers them in
groups of consecutive parameters of at most `bucket_bytes` (full size) each: one collective per group
instead of one per parameter (hundreds of latency-bound gathers for a 7B model), while the transient
memory stays bounded by the group, never the whole model (docs/distributed.md). Every process must
sync at the same steps: the gathers are collectives, which the colocated design (one engine per rank,
synced by the same trainer code) guarantees.

A PEFT (LoRA) policy is pushed as its merged weights, each adapted layer merged while it is read and its base
weights restored bit for bit after (trainers/peft_sync.py); under ZeRO-3 its parameters are gathered whole for
the push, as TRL does for vLLM, since adapters cannot be merged shard by shard.

`sync_weights` always pushes; `WeightSyncer` remembers the optimizer step it last pushed and skips a
push when the policy has not changed since (gradient accumulation and several generations per step
call it repeatedly with the same weights).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from rlspec.rollout.runtime.device import DeviceTimer, synchronize
from rlspec.trainers.peft_sync import check_mergeable, is_peft_model, merged_named_tensors

DEFAULT_BUCKET_MB = 512

# Wrappers that insert a path component into every parameter name below them: FSDP1's
# FullyShardedDataParallel, torch's checkpoint_wrapper (activation checkpointing, also used without
# FSDP) and torch.compile's OptimizedModule. The engine knows the plain Hugging Face names.
WRAPPER_NAME_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrap_model(model: torch.nn.Module, accelerator=None) -> torch.nn.Module:
    """The bare transformers model under accelerate / DDP / DeepSpeed wrappers."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    # DDP and DeepSpeedEngine both keep the wrapped model in `.module`; peel every layer.
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def hf_name(name: str) -> str:
    """A parameter name with the wrapper components (WRAPPER_NAME_PARTS) removed, wherever they sit."""
    for part in WRAPPER_NAME_PARTS:
        name = name.replace(part, "")
    return name


def _is_zero3_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")  # DeepSpeed ZeRO-3 partitions a parameter and tags it with ds_id


def _full_nbytes(param: torch.Tensor) -> int:
    """Bytes of the whole parameter once gathered (a ZeRO-3 shard knows its full numel as ds_numel)."""
    numel = param.ds_numel if _is_zero3_param(param) else param.numel()
    return numel * param.element_size()


def gather_groups(named_params: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of parameters whose full sizes add up to at most `bucket_bytes`; a parameter
    larger than the bucket (an embedding, say) is a group of its own. Order is kept."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes} (rollout.sync_bucket_mb)")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, param in named_params:
        nbytes = _full_nbytes(param)
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, param))
        size += nbytes
    return groups


def _check_syncable(bare: torch.nn.Module) -> None:
    """Refuse, with what to do instead, the policies whose parameters this sync cannot read whole."""
    if is_peft_model(bare):
        check_mergeable(bare)
    if _is_fsdp_sharded(bare):
        raise NotImplementedError(
            "weight sync from an FSDP-sharded policy is not supported: its parameters are flat shards (FSDP1) or "
            "DTensors (FSDP2), not the whole tensors the rollout engine loads. Shard the policy with DeepSpeed "
            "ZeRO-3 instead (accelerate launch --config_file configs/accelerate/zero3.yaml ...), whose shards "
            "rlspec gathers in bounded groups, or with ZeRO-2 / DDP when the policy fits on one device"
        )


def _is_fsdp_sharded(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    import torch.distributed.fsdp as fsdp

    # FSDP1 wraps modules in FullyShardedDataParallel; FSDP2's fully_shard makes them FSDPModules (torch >= 2.6).
    kinds = tuple(k for k in (getattr(fsdp, "FullyShardedDataParallel", None), getattr(fsdp, "FSDPModule", None)) if k)
    return any(isinstance(m, kinds) for m in model.modules())


class NamedWeights:
    """The policy's parameters as (HF name, full tensor) pairs, for `engine.load_weights`.

    Plain (DDP / ZeRO-2 / one process) parameters are yielded as they are, with no copy. ZeRO-3 ones are
    gathered a group at a time (gather_groups) and each is cloned inside the gather, since the gathered
    storage is released when the group's context exits. A PEFT model yields its merged weights under plain
    names (peft_sync.merged_named_tensors), gathered whole under ZeRO-3. `gathers` counts the collective
    gathers done. Close the iterator when a consumer stops early, so that an open gather is released.
    """

    def __init__(self, model: torch.nn.Module, accelerator=None, bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20):
        bare = unwrap_model(model, accelerator)
        _check_syncable(bare)
        self.peft = bare if is_peft_model(bare) else None
        self.named = [(hf_name(name), param) for name, param in bare.named_parameters()]
        self.zero3 = any(_is_zero3_param(p) for _, p in self.named)
        self.groups = gather_groups(self.named, bucket_bytes) if self.zero3 and self.peft is None else []
        self.gathers = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.peft is not None:
            with gathered_model(self.peft):  # one whole gather under ZeRO-3 (a no-op otherwise)
                self.gathers += self.zero3
                yield from merged_named_tensors(self.peft, iter(self.named))
            return
        if not self.zero3:
            for name, param in self.named:
                yield name, param.detach()
            return
        import deepspeed  # only reached when DeepSpeed already partitioned the model, so it is installed

        for group in self.groups:
            sharded = [p for _, p in group if _is_zero3_param(p)]
            gather = deepspeed.zero.GatheredParameters(sharded, modifier_rank=None) if sharded else \
                contextlib.nullcontext()
            with gather:
                self.gathers += bool(sharded)
                for name, param in group:
                    yield name, param.detach().clone()


def iter_named_weights(model: torch.nn.Module, accelerator=None,
                       bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20) -> NamedWeights:
    """(HF name, tensor) for every parameter of the unwrapped model (see NamedWeights)."""
    return NamedWeights(model, accelerator, bucket_bytes)


@contextlib.contextmanager
def gathered_model(model: torch.nn.Module):
    """All parameters at full size inside the block (ZeRO-3: gathered at once; otherwise a no-op).

    Only for building an engine from a partitioned policy, once per run: the engine keeps a full copy
    anyway, so the temporary full gather costs no more than the copy it feeds (syncs use NamedWeights).
    """
    params = [p for p in model.parameters() if _is_zero3_param(p)]
    if not params:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield model


def sync_weights(model: torch.nn.Module, engine, accelerator=None,
                 bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20) -> tuple[float, int]:
    """Push every policy parameter into `engine.load_weights` (bumps engine.policy_version).

    Returns (seconds the push took, ZeRO-3 gathers it made). Under ZeRO-3 every rank must call it
    (the gathers are collectives). The push is ONE load_weights call (the ZeRO-3 groups stream through its
    iterator), so the engine checks the sync as a whole: every runtime tensor written exactly once, else
    rollout.errors.WeightSyncError and the engine keeps its policy_version (a sync split over several calls
    passes complete=False to all but the last).
    """
    weights = iter_named_weights(model, accelerator, bucket_bytes)
    stream = iter(weights)
    # the copies are queued on the device: the seconds are the push's only once they have run
    with DeviceTimer(sync=lambda: _sync_devices(model, engine)) as clock:
        try:
            with torch.no_grad():
                engine.load_weights(stream)
        finally:
            stream.close()  # a push that failed half way still releases its ZeRO-3 gather
    return clock.seconds, weights.gathers


def _sync_devices(model: torch.nn.Module, engine) -> None:
    """Wait for the policy's device and the in-process engine's (its runner's synchronize, rollout/runtime/
    device.py); a backend with no runner here (a Ray pool, vLLM) returns from load_weights when it is done."""
    runner = getattr(engine, "runner", None)
    if callable(getattr(runner, "synchronize", None)):
        runner.synchronize()
    param = next(model.parameters(), None)
    if param is not None:
        synchronize(param.device)


@dataclass
class WeightSyncer:
    """Pushes weights only when the policy changed since the last push, keyed by optimizer step.

    synced_step: the optimizer step (trainer.state.global_step) whose weights the engine holds;
    None when unknown (an engine built elsewhere), which forces the first push.
    bucket_bytes: the most bytes one ZeRO-3 gather brings in (rollout.sync_bucket_mb).
    """

    engine: object
    accelerator: object = None
    synced_step: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_MB * 2**20
    num_syncs: int = 0
    total_time_s: float = 0.0
    last_time_s: float = field(default=0.0)
    last_gathers: int = 0

    def maybe_sync(self, model: torch.nn.Module, step: int) -> bool:
        """Sync if `step` differs from the last synced step; True when weights were pushed."""
        if step == self.synced_step:
            self.last_time_s, self.last_gathers = 0.0, 0
            return False
        self.last_time_s, self.last_gathers = sync_weights(model, self.engine, self.accelerator, self.bucket_bytes)
        self.total_time_s += self.last_time_s
        self.num_syncs += 1
        self.synced_step = step
        return True
