"""PEFT (LoRA) policies: the engine samples from the merged weights (W + scale * B @ A for LoRA).

The engine runs plain Hugging Face weights. For a PEFT policy the push reads every base parameter under its
plain name (`base_model.model.` and `.base_layer` removed, the adapter's own tensors skipped, the active
`modules_to_save` copy under the original name), as TRL does for vLLM (trl/generation/vllm_generation.py,
`_iter_named_params`), and each weight of an adapted layer is sent merged. TRL merges the whole model and
unmerges it after; W + d - d is not W in floating point, so the frozen base would drift a rounding error per
sync (a bf16 ulp per weight, every step). We merge one layer at a time and put its exact original weights back
after reading the merged ones: the base the optimizer sees never changes.

The engine is built from the base model with each PEFT wrapper swapped for its base layer (`engine_source`):
a plain transformers model, whose classes the runtime recognises; the trainer pushes the merged weights right
after (rollout_source.for_trainer). Methods that have no merged weights (prompt learning: prefix/prompt
tuning; trainable tokens) raise UnsupportedModelError, which SpecGRPOTrainer answers with TRL's generation.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlspec.rollout.errors import UnsupportedModelError


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def check_mergeable(model: torch.nn.Module) -> None:
    """UnsupportedModelError unless every adapter of `model` merges into plain weights (LoRA-style adapters and
    modules_to_save copies do; prompt learning and trainable tokens do not)."""
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.other import AuxiliaryTrainingWrapper

    configs = list(model.peft_config.values())
    if any(getattr(c, "is_prompt_learning", False) for c in configs):
        kinds = sorted({str(getattr(c, "peft_type", type(c).__name__)) for c in configs})
        raise UnsupportedModelError(f"PEFT method {kinds} adds virtual tokens rather than weight deltas, so it has no "
                                    "merged weights for rlspec's runtime to load; use a LoRA-style adapter")
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, ModulesToSaveWrapper):
            raise UnsupportedModelError(f"PEFT wrapper {type(module).__name__} at {name!r} (e.g. trainable tokens) "
                                        "has no merged weights for rlspec's runtime to load")


def plain_name(name: str, adapter_prefix: str) -> str | None:
    """The Hugging Face name of a PEFT parameter, or None for the adapter's own tensors (merged into the base
    weights instead) and the frozen originals that `modules_to_save` replaces."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if adapter_prefix in name or "original_module" in name:
        return None
    return name.replace("modules_to_save.default.", "")


def merged_named_tensors(model: torch.nn.Module, named: Iterator[tuple[str, torch.Tensor]]):
    """(plain name, merged tensor) for `named` (the PEFT model's named_parameters()). A base weight of an adapted
    layer is read merged: that layer alone is merged, its weight cloned, unmerged and its exact original bits
    restored (a merge may also change the bias, with lora_bias, so each of the layer's tensors goes the same way)."""
    check_mergeable(model)
    owners = _adapted_layers(model)
    for name, param in named:
        hf = plain_name(name, model.prefix)
        if hf is None:
            continue
        layer = owners.get(id(param))
        yield hf, (param.detach() if layer is None else _merged(layer, param))


def _adapted_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(base parameter) -> the PEFT tuner layer (LoRA, ...) it belongs to, for layers whose adapters are not
    merged in already. By identity, not name, so that wrapper name parts cannot hide a layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {id(p): m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.merged
            for p in m.get_base_layer().parameters()}


@torch.no_grad()
def _merged(layer: torch.nn.Module, param: torch.Tensor) -> torch.Tensor:
    originals = [p.detach().clone() for p in layer.get_base_layer().parameters()]
    layer.merge()
    try:
        return param.detach().clone()
    finally:
        layer.unmerge()
        for p, original in zip(layer.get_base_layer().parameters(), originals, strict=True):
            p.copy_(original)  # unmerge leaves W + d - d; the optimizer's base must stay bit for bit W


def _plain_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The plain module standing in for a PEFT wrapper (None: not a wrapper): a tuner layer's base layer, a
    modules_to_save wrapper's active trained copy."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, BaseTunerLayer):
        return module.get_base_layer()
    if isinstance(module, ModulesToSaveWrapper):
        return module.unload_and_optionally_merge_module(merge=False, safe_merge=False, adapter_names=None)
    return None


@contextlib.contextmanager
def engine_source(policy: torch.nn.Module):
    """What a rollout backend builds from: `policy` itself, or for a PEFT model its base transformers model with
    every PEFT wrapper swapped for the plain module under it (undone after the block), so the backend sees a plain
    model's classes, config, parameters() and state_dict() (or save_pretrained). It holds the unmerged base
    weights: the trainer pushes the merged ones before the first rollout (rollout_source.for_trainer)."""
    if not is_peft_model(policy):
        yield policy
        return
    check_mergeable(policy)
    base = policy.get_base_model()
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    swapped: list[str] = []  # names (before the swap) of the wrappers replaced: what lies inside them is gone too
    try:
        for name, module in list(base.named_modules()):
            plain = _plain_module(module)
            if plain is None or any(name.startswith(done + ".") for done in swapped):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = base.get_submodule(parent_name)
            swaps.append((parent, child, module))
            swapped.append(name)
            setattr(parent, child, plain)
        yield base
    finally:
        for parent, child, module in reversed(swaps):
            setattr(parent, child, module)
