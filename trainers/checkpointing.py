"""Activation checkpointing on a model, under every transformers this project runs on.

transformers 5.24 renamed `gradient_checkpointing_enable` / `_disable` / `is_gradient_checkpointing` to
`activation_checkpointing_*`. The old names still work there, with a FutureWarning each call, and go in v6; the new
ones do not exist before 5.24 (the GPU machine has 5.17). So the trainers call these, which take the new name where
the model has it. A module of ours that wraps models (PPO's policy and value model) defines both names, since the
Trainer calls whichever the transformers of the day knows; without the new one, 5.24's Trainer warns and v6's would
leave the policy's activations all kept, without a word.
"""
from __future__ import annotations

from torch import nn


def args_name(args) -> str:
    """The training arguments' name for it (a TrainingArguments class or instance): `activation_checkpointing` from
    5.24 (which keeps the old name as a copy of the new until v6), `gradient_checkpointing` before."""
    return "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"


def asked(args) -> tuple[bool, dict | None]:
    """(on, kwargs) as the training arguments ask, by the name they give it."""
    name = args_name(args)
    return bool(getattr(args, name)), getattr(args, f"{name}_kwargs", None)


def is_on(model: nn.Module) -> bool:
    """Whether checkpointing is on (a module without either name: True, so that nothing turns it on)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return on if on is not None else getattr(model, "is_gradient_checkpointing", True)


def enable(model: nn.Module, kwargs: dict | None = None, **options) -> None:
    """Checkpointing on. kwargs: the user's (TrainingArguments' `*_checkpointing_kwargs`): the Trainer's own keys
    (every_n_layers, offload) come out, as the Trainer takes them out, and the rest go to torch.utils.checkpoint;
    options: those two keys, given apart."""
    kwargs = dict(kwargs or {})
    options = {key: kwargs.pop(key) for key in ("every_n_layers", "offload") if key in kwargs} | options
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **options)


def disable(model: nn.Module) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
