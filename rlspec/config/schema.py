"""The top-level `Config` (a whole run: a few scalars plus the sections) and the checks that span fields.

`Config.__post_init__` checks the top-level fields against their rules (rlspec/config/ranges.py; the
reward names against trainers/rewards.py's registry; each section checks its own fields when built),
then the semantic checks below (batch sizes against the group size and the data, the rollout's room for
the prompt, `extra` keys that would shadow a first-class key, Ray settings, ...); they raise
`ConfigError`, which the loader (rlspec/config/loader.py) reports with the config's source prepended.
The sections themselves are in rlspec/config/sections.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from rlspec.config.ranges import NON_EMPTY, SEED, check_fields, names_list
from rlspec.config.sections import (
    DataConfig,
    DrafterSection,
    GRPOSection,
    PartialRolloutsSection,
    PPOSection,
    RLOOSection,
    RolloutSection,
    TRLSection,
    WandbSection,
    _f,
)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says what and how to fix it."""


def _reward_names() -> list[str]:
    """The reward registry, read when a config is checked (a reward registered by then counts)."""
    from rlspec.trainers.rewards import REWARD_FUNCS  # plain Python (re only; math_verify is imported when scoring)

    return list(REWARD_FUNCS)


@dataclass
class Config:
    """A whole training run."""

    trainer: Literal["grpo", "rloo", "ppo"] = _f("grpo", "which RL algorithm trains the policy (grpo: SpecGRPOTrainer, "
                                                         "rloo: SpecRLOOTrainer, ppo: PPOTrainer)")
    model: str = _f("smollm2-135m-instruct", "local HF directory, hub id, or the embedded alias "
                                             "'smollm2-135m-instruct'", rule=NON_EMPTY)
    dtype: Literal["bfloat16", "float32"] = _f(
        "bfloat16", "bfloat16: rollouts in bf16, training under bf16 autocast with float32 master weights "
                    "(pure bf16 weights would round lr=1e-6 updates away; float32 on a CPU without native bf16, "
                    "which would emulate it); float32: everything in fp32")
    seed: int = _f(0, "global seed", rule=SEED)
    output_dir: str = _f("outputs/run", "checkpoints, final model, summary.json and W&B files go here",
                         rule=NON_EMPTY)
    resume: str | None = _f("none", "none: start at step 0 (output_dir must be empty, or overwrite_output_dir=true); "
                                    "auto: continue from the newest complete checkpoint-N in output_dir (step 0 "
                                    "when there is none; half-written ones are skipped and reported); or a "
                                    "checkpoint directory to continue from (docs/resume.md)", rule=NON_EMPTY)
    overwrite_output_dir: bool = _f(False, "start at step 0 in an output_dir that already holds a run: what "
                                           "rlspec wrote there (the names in its rlspec-manifest.txt) is deleted "
                                           "first; other files are left alone (docs/resume.md)")
    on_nonfinite: Literal["stop", "skip_batch"] = _f(
        "stop", "NaN/inf logits in a rollout: stop = write a checkpoint of the state before the failing step and "
                "exit non-zero; skip_batch = skip that step's batch (no update), count it in "
                "rollout/nonfinite_skipped and go on")
    rewards: list[str] = _f(help="reward function names, summed (e.g. accuracy, format)", factory=lambda: ["accuracy"],
                            rule=names_list("reward functions (trainers/rewards.py)", _reward_names))
    data: DataConfig = _f(help="training prompts", factory=DataConfig)
    grpo: GRPOSection = _f(help="GRPO hyperparameters (trl.GRPOConfig); read when trainer is grpo", factory=GRPOSection)
    rloo: RLOOSection = _f(help="RLOO hyperparameters (trl.RLOOConfig); read when trainer is rloo", factory=RLOOSection)
    ppo: PPOSection = _f(help="PPO hyperparameters (trainers.ppo_config.PPOConfig); read when trainer is ppo",
                         factory=PPOSection)
    rollout: RolloutSection = _f(help="rollout engine capacity", factory=RolloutSection)
    drafter: DrafterSection = _f(help="speculative decoding", factory=DrafterSection)
    partial_rollouts: PartialRolloutsSection = _f(help="partial rollouts (grpo): carry unfinished samples into the "
                                                       "next generation round", factory=PartialRolloutsSection)
    wandb: WandbSection = _f(help="Weights & Biases logging", factory=WandbSection)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for W&B's run config and summary.json)."""
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        try:
            check_fields(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_cross_fields(self)

    @property
    def algorithm(self) -> GRPOSection | RLOOSection | PPOSection:
        """The section of the trainer this run uses (grpo, rloo or ppo)."""
        return getattr(self, self.trainer)


# ---------------------------------------------------------------------------------------------
# Checks that span fields (run by Config.__post_init__)


def _check_cross_fields(cfg: Config) -> None:
    """Checks that span fields; raised as ConfigError by build() with the source prepended."""
    if cfg.resume is None:
        cfg.resume = "none"
    if cfg.resume != "none" and cfg.overwrite_output_dir:
        raise ConfigError(f"resume={cfg.resume} continues the run in output_dir, overwrite_output_dir=true deletes it: "
                          "set one of them")
    if cfg.trainer in ("grpo", "rloo"):
        _check_grpo(cfg.algorithm, cfg.data.num_examples, cfg.trainer)
    else:
        _check_ppo(cfg.ppo)
    g = cfg.algorithm
    if cfg.rollout.max_model_len <= g.max_completion_length:
        raise ConfigError(
            f"rollout.max_model_len ({cfg.rollout.max_model_len}) must exceed {cfg.trainer}.max_completion_length "
            f"({g.max_completion_length}) to leave room for the prompt"
        )
    _check_extras(cfg)
    if cfg.trainer == "rloo" and cfg.drafter.lossy:
        raise ConfigError("a lossy mode (drafter.verification / drafter.step_routing) samples off-policy tokens, and "
                          "RLOO has no importance-sampling correction to account for them: turn the lossy mode off "
                          "or use trainer=grpo")
    key = "vllm_importance_sampling_correction" if cfg.trainer == "grpo" else "importance_sampling_correction"
    if cfg.drafter.lossy and not g.extra.get(key, True):
        raise ConfigError(f"a lossy mode (drafter.verification / drafter.step_routing) samples off-policy tokens, but "
                          f"{cfg.trainer}.extra.{key} is false: the loss would treat them as on-policy. Turn the "
                          "importance-sampling correction back on, or the lossy mode off")
    _check_rollout(cfg.rollout)
    if cfg.partial_rollouts.enabled and (cfg.trainer != "grpo" or cfg.rollout.backend != "engine"):
        raise ConfigError(f"partial_rollouts.enabled needs trainer=grpo and rollout.backend=engine (got trainer="
                          f"{cfg.trainer}, rollout.backend={cfg.rollout.backend}): only the in-process engine stops a "
                          "round and carries samples on (vLLM runs each request to its end; the Ray pool's workers "
                          "each run their groups to the end, and a round's stop is one decision over all groups: "
                          "docs/partial_rollouts.md#limits); turn partial_rollouts.enabled off or switch")
    if cfg.partial_rollouts.enabled:
        from rlspec.trainers.partial_rollouts import why_not_with_this_loss  # plain Python

        extra = cfg.grpo.extra
        why = why_not_with_this_loss(extra.get("vllm_importance_sampling_correction", True), cfg.grpo.beta,
                                     extra.get("off_policy_mask_threshold"), extra.get("loss_type", "dapo"))
        if why is not None:
            raise ConfigError(f"partial_rollouts.enabled: {why} (grpo.extra); or turn partial_rollouts.enabled off")


# TrainingArguments fields rlspec/trainer_args.py fills from a first-class key. In <grpo|ppo>.extra they would
# part the trainer from the rest of the run: checkpoints in another directory than the one resume and
# overwrite_output_dir look in, training precision other than the rollouts', ...
_MANAGED = {"output_dir": "output_dir", "seed": "seed", "run_name": "wandb.run_name", "bf16": "dtype",
            "fp16": "dtype", "resume_from_checkpoint": "resume", "overwrite_output_dir": "overwrite_output_dir"}


def _check_extras(cfg: Config) -> None:
    """`extra` passes other keyword arguments through; a key that a first-class key already sets is refused,
    naming that key (a second, silent way to set one thing is how runs end up where no one looks)."""
    for name in ("grpo", "rloo", "ppo", "data"):
        section = getattr(cfg, name)
        first_class = {f.name: f"{name}.{f.name}" for f in dataclasses.fields(section) if f.name != "extra"}
        if name == "data":
            first_class["config"] = "data.subset"  # load_dataset_by_name's name for the subset
        else:
            first_class.update(_MANAGED)
            if "activation_checkpointing" in first_class:  # trainer_args' name for it on older transformers
                first_class["gradient_checkpointing"] = f"{name}.activation_checkpointing"
        for key in section.extra:
            if key in first_class:
                target = first_class[key]
                raise ConfigError(f"{name}.extra.{key} shadows the first-class key {target}: set {target} instead "
                                  f"(the rest of the run reads {target}, so the two would disagree)")


def _check_rollout(r: RolloutSection) -> None:
    """The backend Ray settings need (several workers or a cluster address mean Ray: set here, so
    `rollout.workers=4` alone is enough); their numbers are checked by RolloutSection's rules."""
    wants_ray = (r.workers or 1) > 1 or r.ray_address is not None
    if wants_ray and r.backend == "engine":
        r.backend = "ray"
    elif wants_ray and r.backend != "ray":
        raise ConfigError(f"rollout.workers / rollout.ray_address run engine replicas on Ray, but rollout.backend is "
                          f"{r.backend!r}; set rollout.backend=ray or drop them")


def _check_grpo(g: TRLSection, num_examples: int | None, name: str = "grpo") -> None:
    """The batch checks of TRL's group-sampling trainers (grpo, rloo: `name` is the section)."""
    if {"generation_batch_size", "steps_per_generation"} & set(g.extra):
        return  # TRL derives the generation batch from those; it checks them itself
    batch = g.per_device_train_batch_size * g.gradient_accumulation_steps
    if batch % g.num_generations:
        raise ConfigError(
            f"{name}.per_device_train_batch_size * {name}.gradient_accumulation_steps ({batch}) must be a multiple "
            f"of {name}.num_generations ({g.num_generations}); e.g. set {name}.per_device_train_batch_size="
            f"{max(g.num_generations, batch // g.num_generations * g.num_generations)}"
        )
    prompts = batch // g.num_generations
    if num_examples is not None and num_examples < prompts:
        # TRL's sampler drops a partial batch of prompts: the run would train 0 steps and exit 0
        raise ConfigError(f"data.num_examples ({num_examples}) is fewer than the {prompts} prompts one step samples "
                          f"({name}.per_device_train_batch_size * {name}.gradient_accumulation_steps / "
                          f"{name}.num_generations): the run would train 0 steps. Set data.num_examples >= {prompts}")


def _check_ppo(p: PPOSection) -> None:
    rollout = p.per_device_train_batch_size * p.num_mini_batches
    if rollout % p.num_generations:
        raise ConfigError(
            f"ppo.per_device_train_batch_size * ppo.num_mini_batches ({rollout}) must be a multiple of "
            f"ppo.num_generations ({p.num_generations}): every prompt gets all its samples in one rollout"
        )
