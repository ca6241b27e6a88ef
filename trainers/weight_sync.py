"""Policy -> engine weight sync: push the trainer's current parameters into the rollout engine.

The engine keeps its own copy of the weights (its own layout and dtype), so after every optimizer
step the trainer must hand it the new parameters before the next rollout, or the rollouts would be
sampled from a stale policy and the importance-sampling check would show it.

`sync_weights` always pushes; `WeightSyncer` remembers the optimizer step it last pushed and skips a
push when the policy has not changed since (gradient accumulation and several generations per step
call it repeatedly with the same weights).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def unwrap_model(model: torch.nn.Module, accelerator=None) -> torch.nn.Module:
    """The bare transformers model under accelerate / DDP / DeepSpeed wrappers."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    # DDP and DeepSpeedEngine both keep the wrapped model in `.module`; peel every layer.
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _is_zero3_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")  # DeepSpeed ZeRO-3 partitions a parameter and tags it with ds_id


@contextlib.contextmanager
def _gathered(param: torch.Tensor):
    """Full value of one parameter: gathered from its ZeRO-3 shards when partitioned, as-is otherwise."""
    if not _is_zero3_param(param):
        yield param
        return
    import deepspeed  # only reached when DeepSpeed already partitioned the model, so it is installed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        yield param


@contextlib.contextmanager
def gathered_model(model: torch.nn.Module):
    """All parameters at full size inside the block (ZeRO-3: gathered at once; otherwise a no-op).

    For building an engine from a partitioned policy: the engine keeps a full copy anyway, so the
    temporary full gather costs no more than the copy it feeds. (Not exercised on the CPU test box.)
    """
    params = [p for p in model.parameters() if _is_zero3_param(p)]
    if not params:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield model


def iter_named_weights(model: torch.nn.Module, accelerator=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of the unwrapped model, one at a time.

    ZeRO-3 parameters are gathered one by one (memory stays one parameter above the shard) and
    cloned, since the gathered storage is released when the context exits.
    """
    bare = unwrap_model(model, accelerator)
    if hasattr(bare, "peft_config"):
        raise NotImplementedError(
            "weight sync of a PEFT (LoRA) model is not supported yet: merge the adapter into the base model "
            "(model.merge_and_unload()) or train without PEFT"
        )
    for name, param in bare.named_parameters():
        with _gathered(param) as full:
            tensor = full.detach()
            yield name, (tensor.clone() if _is_zero3_param(param) else tensor)


def sync_weights(model: torch.nn.Module, engine, accelerator=None) -> float:
    """Push every policy parameter into `engine.load_weights` (bumps engine.policy_version).

    Returns the seconds the push took. Under ZeRO-3 every rank must call it (the gather is collective).
    """
    start = time.perf_counter()
    with torch.no_grad():
        engine.load_weights(iter_named_weights(model, accelerator))
    return time.perf_counter() - start


@dataclass
class WeightSyncer:
    """Pushes weights only when the policy changed since the last push, keyed by optimizer step.

    synced_step: the optimizer step (trainer.state.global_step) whose weights the engine holds;
    None when unknown (an engine built elsewhere), which forces the first push.
    """

    engine: object
    accelerator: object = None
    synced_step: int | None = None
    num_syncs: int = 0
    total_time_s: float = 0.0
    last_time_s: float = field(default=0.0)

    def maybe_sync(self, model: torch.nn.Module, step: int) -> bool:
        """Sync if `step` differs from the last synced step; True when weights were pushed."""
        if step == self.synced_step:
            self.last_time_s = 0.0
            return False
        self.last_time_s = sync_weights(model, self.engine, self.accelerator)
        self.total_time_s += self.last_time_s
        self.num_syncs += 1
        self.synced_step = step
        return True
