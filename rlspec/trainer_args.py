"""The trainer's own config object (trl.GRPOConfig, trl.RLOOConfig or trainers' PPOConfig) from an rlspec Config.

One recipe for all: the algorithm's section (grpo:, rloo: or ppo:) gives the named fields, the run settings
give the fields rlspec manages (output_dir, device, precision, W&B, seed), and `<section>.extra`
passes any other field of the target class, checked against its fields with a did-you-mean hint.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
from pathlib import Path

from rlspec.config import Config, ConfigError

logger = logging.getLogger(__name__)


def build_trainer_args(cfg: Config, out: Path):
    """trl.GRPOConfig (trainer: grpo), trl.RLOOConfig (trainer: rloo) or trainers.ppo_config.PPOConfig (trainer: ppo)."""
    if cfg.trainer == "ppo":
        from rlspec.trainers.ppo.config import PPOConfig

        return _build(cfg, out, PPOConfig)
    import trl

    return _build(cfg, out, trl.RLOOConfig if cfg.trainer == "rloo" else trl.GRPOConfig)


def _build(cfg: Config, out: Path, cls):
    import torch

    from rlspec.trainers import checkpointing

    name = cfg.trainer
    section_cfg = cfg.algorithm
    valid = {f.name for f in dataclasses.fields(cls)}
    section = {k: v for k, v in dataclasses.asdict(section_cfg).items() if k != "extra" and v is not None}
    if "activation_checkpointing" in section:
        # transformers < 5.24 (the one vLLM pins, .venv-vllm) calls it gradient_checkpointing
        section[checkpointing.args_name(cls)] = section.pop("activation_checkpointing")
    for key in section_cfg.extra:
        if key in section:
            raise ConfigError(f"{name}.extra.{key}: {key} is a {name} key; set {name}.{key} instead")
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{name}.extra.{key} is not a {cls.__module__.split('.')[0]}.{cls.__name__} field.{hint}")
    # fields rlspec sets from other parts of the config; <section>.extra may still override them
    managed = dict(
        output_dir=str(out),
        use_cpu=not torch.cuda.is_available(),
        # bf16 = autocast over float32 master weights: pure bf16 weights would round lr~1e-6 updates to zero.
        bf16=_bf16(cfg),
        model_init_kwargs={"dtype": "float32"},
        report_to="none" if cfg.wandb.mode == "disabled" else ["wandb"],
        run_name=cfg.wandb.run_name or out.name,
        seed=cfg.seed,
    )
    try:
        return cls(**{**section, **managed, **section_cfg.extra})
    except ValueError as exc:  # PPOConfig's own validation: report it as the config error it is
        raise ConfigError(f"{name}: {exc}") from None


def _bf16(cfg: Config) -> bool:
    """Whether training autocasts to bf16: dtype bfloat16, on a GPU or a CPU with native bf16 arithmetic. Elsewhere
    oneDNN emulates it: a forward and backward took 22x as long as in float32 (docs/sampling_dtype.md), so the run
    trains in float32, and rlspec.train samples in the training pass's precision."""
    import torch

    from rlspec.trainers.sampling_dtype import cpu_supports

    if cfg.dtype != "bfloat16":
        return False
    if torch.cuda.is_available() or cpu_supports(torch.bfloat16):
        return True
    logger.warning("rlspec.train: dtype bfloat16, but this CPU has no native bf16 arithmetic (bf16 would be emulated, "
                   "many times slower than float32): training and rollouts run in float32")
    return False
