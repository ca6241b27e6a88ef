"""Which model families rlspec's runtime computes, and how a model is recognised as one of them.

A family is a transformers modeling module whose arithmetic the runtime reproduces (config.py reads its
switches). The rule is about computation, not names:

  * a live model (`family_of_model`, what RolloutEngine.from_hf_model and the trainers pass) is a family F
    when its class is transformers' own F causal LM or a subclass of it that defines no forward of its own,
    and every submodule below it is an exact instance of F's modeling classes, of torch.nn's Linear, Embedding or
    ModuleList, or of transformers.activations. A trust_remote_code subclass registered as "custom_llama" is therefore a Llama;
    a subclass that overrides a forward, swaps in a module of its own (a quantised Linear, a PEFT adapter,
    another family's attention) or is some other class altogether is refused, whatever its model_type says:
    the runtime must never run a model whose computation differs from what it computes. What the checks
    cannot see: forward hooks and per-instance patches. They are the trainer's own (TRL's
    cast_lm_head_to_fp32 patches lm_head.forward to the same product in float32), so they are allowed.
  * a config alone (a checkpoint directory: load_model) says nothing about the code that will run it, so
    there the model_type must name a family; a subclass config with another model_type is recognised only
    through a live model.
"""
from __future__ import annotations

import importlib
from typing import Any

from rlspec.rollout.errors import UnsupportedModelError

# family (transformers' model_type) -> (modeling module under transformers.models, causal-LM class name)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama.modeling_llama", "LlamaForCausalLM"),
    "mistral": ("mistral.modeling_mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma": ("gemma.modeling_gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
}
# what any family may hold besides its own classes: torch's plain Linear, Embedding and ModuleList (exactly those:
# an nn.Identity or a Dropout in place of a transformers module would change the computation) and activations
_TORCH_MODULES = ("Linear", "Embedding", "ModuleList")
_ACTIVATIONS = "transformers.activations"
_USE_TRL = "use trl.GRPOTrainer's own generation (or vLLM) for this model"


def _modeling(family: str) -> str:
    return "transformers.models." + FAMILIES[family][0]


def _causal_lm(family: str) -> type:
    module, name = FAMILIES[family]
    return getattr(importlib.import_module("transformers.models." + module), name)


def family_of_config(hf: Any) -> str:
    """The family a config alone names (its model_type); refuses the rest by name."""
    mt = getattr(hf, "model_type", "llama")
    if mt in FAMILIES:
        return mt
    raise UnsupportedModelError(
        f"model_type {mt!r} is not one rlspec's runtime computes ({sorted(FAMILIES)}); a model of another "
        "model_type is recognised only from a live transformers model whose classes are one of those families' "
        f"(RolloutEngine.from_hf_model); {_USE_TRL}")


def family_of_model(hf_model: Any) -> str:
    """The family whose computation `hf_model` runs (module docstring); UnsupportedModelError otherwise."""
    cls = type(hf_model)
    family = next((f for f in FAMILIES if _is_subclass(cls, f)), None)
    if family is None:
        raise UnsupportedModelError(
            f"{cls.__module__}.{cls.__name__} (model_type "
            f"{getattr(getattr(hf_model, 'config', None), 'model_type', None)!r}) is not a "
            f"causal LM rlspec's runtime computes: it is none of transformers' "
            f"{', '.join(FAMILIES[f][1] for f in FAMILIES)} nor a subclass of one; {_USE_TRL}")
    base = _causal_lm(family)
    for klass in cls.__mro__[: cls.__mro__.index(base)]:  # the subclasses between the model and transformers'
        own = sorted({"forward", "__call__", "_call_impl"} & set(vars(klass)))
        if own:
            raise UnsupportedModelError(
                f"{klass.__module__}.{klass.__name__} subclasses transformers' {base.__name__} but defines its own "
                f"{own}: its computation may differ from the {family} runtime's; {_USE_TRL}")
    import torch.nn as nn

    plain = tuple(getattr(nn, n) for n in _TORCH_MODULES)
    for name, module in hf_model.named_modules():
        where = type(module).__module__
        if name and type(module) not in plain and where not in (_modeling(family), _ACTIVATIONS):
            raise UnsupportedModelError(
                f"module {name!r} of the {family} model is a {where}.{type(module).__name__}, not one of "
                f"transformers' {family} classes: rlspec's runtime computes only the plain {family} layout "
                f"(no quantised layers, adapters or custom modules); {_USE_TRL}")
    return family


def _is_subclass(cls: type, family: str) -> bool:
    try:
        return issubclass(cls, _causal_lm(family))
    except (ImportError, AttributeError):  # a transformers without that family: nothing can be one of it
        return False
