"""The top-level `Config` (a whole run: a few scalars plus the sections) and the checks that span fields.

`Config.__post_init__` runs the semantic checks below (batch sizes against the group size, the
rollout's room for the prompt, Ray settings, ...); they raise `ConfigError`, which the loader
(rlspec/config/loader.py) reports with the config's source prepended. The sections themselves are in
rlspec/config/sections.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from rlspec.config.sections import (
    DataConfig,
    DrafterSection,
    GRPOSection,
    PPOSection,
    RolloutSection,
    WandbSection,
    _f,
)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says what and how to fix it."""


@dataclass
class Config:
    """A whole training run."""

    trainer: Literal["grpo", "ppo"] = _f("grpo", "which RL algorithm trains the policy")
    model: str = _f("smollm2-135m-instruct", "local HF directory, hub id, or the embedded alias "
                                             "'smollm2-135m-instruct'")
    dtype: Literal["bfloat16", "float32"] = _f(
        "bfloat16", "bfloat16: rollouts in bf16, training under bf16 autocast with float32 master weights "
                    "(pure bf16 weights would round lr=1e-6 updates away); float32: everything in fp32")
    seed: int = _f(0, "global seed")
    output_dir: str = _f("outputs/run", "checkpoints, final model, summary.json and W&B files go here")
    resume: str | None = _f("none", "none: start at step 0 (output_dir must be empty, or overwrite_output_dir=true); "
                                    "auto: continue from the newest complete checkpoint-N in output_dir (step 0 "
                                    "when there is none; half-written ones are skipped and reported); or a "
                                    "checkpoint directory to continue from (docs/resume.md)")
    overwrite_output_dir: bool = _f(False, "start at step 0 in an output_dir that already holds a run: its "
                                           "checkpoints, final/, crash/, drafter/, summary.json and README.md are "
                                           "deleted first (other files are left alone)")
    on_nonfinite: Literal["stop", "skip_batch"] = _f(
        "stop", "NaN/inf logits in a rollout: stop = write a checkpoint of the state before the failing step and "
                "exit non-zero; skip_batch = skip that step's batch (no update), count it in "
                "rollout/nonfinite_skipped and go on")
    rewards: list[str] = _f(help="reward function names, summed (e.g. accuracy, format)", factory=lambda: ["accuracy"])
    data: DataConfig = _f(help="training prompts", factory=DataConfig)
    grpo: GRPOSection = _f(help="GRPO hyperparameters (trl.GRPOConfig); read when trainer is grpo", factory=GRPOSection)
    ppo: PPOSection = _f(help="PPO hyperparameters (trainers.ppo_config.PPOConfig); read when trainer is ppo",
                         factory=PPOSection)
    rollout: RolloutSection = _f(help="rollout engine capacity", factory=RolloutSection)
    drafter: DrafterSection = _f(help="speculative decoding", factory=DrafterSection)
    wandb: WandbSection = _f(help="Weights & Biases logging", factory=WandbSection)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for W&B's run config and summary.json)."""
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        _check_cross_fields(self)

    @property
    def algorithm(self) -> GRPOSection | PPOSection:
        """The section of the trainer this run uses (grpo or ppo)."""
        return self.ppo if self.trainer == "ppo" else self.grpo


# ---------------------------------------------------------------------------------------------
# Checks that span fields (run by Config.__post_init__)


def _check_cross_fields(cfg: Config) -> None:
    """Checks that span fields; raised as ConfigError by build() with the source prepended."""
    if cfg.resume is None:
        cfg.resume = "none"
    if cfg.resume != "none" and cfg.overwrite_output_dir:
        raise ConfigError(f"resume={cfg.resume} continues the run in output_dir, overwrite_output_dir=true deletes it: "
                          "set one of them")
    if cfg.trainer == "grpo":
        _check_grpo(cfg.grpo)
    else:
        _check_ppo(cfg.ppo)
    g = cfg.algorithm
    if cfg.rollout.max_model_len <= g.max_completion_length:
        raise ConfigError(
            f"rollout.max_model_len ({cfg.rollout.max_model_len}) must exceed {cfg.trainer}.max_completion_length "
            f"({g.max_completion_length}) to leave room for the prompt"
        )
    if cfg.rollout.sync_bucket_mb <= 0:
        raise ConfigError(f"rollout.sync_bucket_mb must be > 0 (megabytes per ZeRO-3 gather), got "
                          f"{cfg.rollout.sync_bucket_mb}")
    if not cfg.rewards:
        raise ConfigError("rewards is empty; name at least one reward function (e.g. rewards=[accuracy])")
    key = "vllm_importance_sampling_correction" if cfg.trainer == "grpo" else "importance_sampling_correction"
    if cfg.drafter.lossy and not g.extra.get(key, True):
        raise ConfigError(f"a lossy mode (drafter.verification / drafter.step_routing) samples off-policy tokens, but "
                          f"{cfg.trainer}.extra.{key} is false: the loss would treat them as on-policy. Turn the "
                          "importance-sampling correction back on, or the lossy mode off")
    _check_rollout(cfg.rollout)


def _check_rollout(r: RolloutSection) -> None:
    """Ray settings: valid numbers, and the backend they need (several workers or a cluster address
    mean Ray: set here, so `rollout.workers=4` alone is enough)."""
    if r.workers is not None and r.workers < 1:
        raise ConfigError(f"rollout.workers must be >= 1 (or unset), got {r.workers}")
    if r.groups_per_task < 1:
        raise ConfigError(f"rollout.groups_per_task must be >= 1, got {r.groups_per_task}")
    if r.worker_threads is not None and r.worker_threads < 1:
        raise ConfigError(f"rollout.worker_threads must be >= 1 (or unset), got {r.worker_threads}")
    if r.drafter_trainer_gpus < 0:
        raise ConfigError(f"rollout.drafter_trainer_gpus must be >= 0, got {r.drafter_trainer_gpus}")
    wants_ray = (r.workers or 1) > 1 or r.ray_address is not None
    if wants_ray and r.backend == "engine":
        r.backend = "ray"
    elif wants_ray and r.backend != "ray":
        raise ConfigError(f"rollout.workers / rollout.ray_address run engine replicas on Ray, but rollout.backend is "
                          f"{r.backend!r}; set rollout.backend=ray or drop them")


def _check_grpo(g: GRPOSection) -> None:
    if g.num_generations < 2:
        raise ConfigError(f"grpo.num_generations must be >= 2 (GRPO compares samples within a group), "
                          f"got {g.num_generations}")
    batch = g.per_device_train_batch_size * g.gradient_accumulation_steps
    if not {"generation_batch_size", "steps_per_generation"} & set(g.extra) and batch % g.num_generations:
        raise ConfigError(
            f"grpo.per_device_train_batch_size * grpo.gradient_accumulation_steps ({batch}) must be a multiple "
            f"of grpo.num_generations ({g.num_generations}); e.g. set grpo.per_device_train_batch_size="
            f"{max(g.num_generations, batch // g.num_generations * g.num_generations)}"
        )


def _check_ppo(p: PPOSection) -> None:
    rollout = p.per_device_train_batch_size * p.num_mini_batches
    if p.num_generations < 1 or rollout % p.num_generations:
        raise ConfigError(
            f"ppo.per_device_train_batch_size * ppo.num_mini_batches ({rollout}) must be a multiple of "
            f"ppo.num_generations ({p.num_generations}, >= 1): every prompt gets all its samples in one rollout"
        )
