"""The YAML sections of a run's config, one dataclass each: data, grpo, rloo, ppo, rollout, drafter, wandb.

Each field carries its default, a help string and the rule its values follow (`_f`; rules in
rlspec/config/ranges.py, checked when a section is built), which `format_help` prints for
`python -m rlspec.train --help`. The top-level `Config` that holds these sections, and the checks
that span them, are in rlspec/config/schema.py; reading YAML and overrides into them is in
rlspec/config/loader.py. No heavy imports: the CLI parses its config before torch is imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rlspec.config.ranges import (
    AT_LEAST_0,
    AT_LEAST_1,
    DIRECTORY,
    FRACTION,
    MATH_OPS,
    NON_EMPTY,
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    STEPS,
    UNIT,
    Rule,
    at_least,
    check_fields,
    registered,
    subset_of,
)
from rlspec.rollout.types import SpecConfig  # plain dataclasses, no torch


def _f(default: Any = None, help: str = "", factory: Any = None, rule: Rule | None = None) -> Any:
    """A dataclass field carrying its help string (shown by `python -m rlspec.train --help`) and the rule
    its values must follow (rlspec/config/ranges.py; bools and Literals need none: their type is the rule)."""
    metadata = {"help": help, **({"rule": rule} if rule is not None else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _backends() -> list[str]:
    from rlspec.rollout.backend import BACKENDS  # plain Python: each backend's module is imported only when built

    return list(BACKENDS)


class _Checked:
    """A section whose fields are checked against their rules when it is built."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class DataConfig(_Checked):
    """Which prompts to train on."""

    name: str = _f("embedded_math", "'embedded_math' (generated arithmetic, no download) or a hub dataset id "
                                    "such as 'openai/gsm8k'", rule=NON_EMPTY)
    subset: str | None = _f(None, "hub dataset config name, e.g. 'main' for openai/gsm8k", rule=NON_EMPTY)
    split: str = _f("train", "dataset split to train on", rule=NON_EMPTY)
    num_examples: int | None = _f(None, "keep this many examples (None = all; embedded_math then generates 256)",
                                   rule=AT_LEAST_1)
    max_operand: int = _f(9, "embedded_math: largest operand (9 = single-digit problems, on which "
                             "SmolLM2-135M earns a mean reward of ~0.25)", rule=AT_LEAST_1)
    ops: list[str] = _f(help="embedded_math: operators to draw from (+, -, *)", factory=lambda: ["+"],
                        rule=subset_of(MATH_OPS))
    seed: int = _f(0, "seed for generating/shuffling the data", rule=SEED)
    drop_long_prompts: bool = _f(False, "prompts too long for the rollout context (rollout.max_model_len) are "
                                        "found before step 1: false = refuse the run naming them, true = drop "
                                        "them and say how many")
    extra: dict = _f(help="other keyword arguments of trainers.data.load_dataset_by_name (e.g. question_column)",
                     factory=dict)


@dataclass
class TRLSection(_Checked):
    """The fields trl.GRPOConfig and trl.RLOOConfig share (same names and meaning), declared once for the grpo: and
    rloo: sections; `extra` passes any other field of the trainer's config."""

    num_generations: int = _f(8, "completions sampled per prompt (the group size G)",
                              rule=at_least(2, "the advantage compares samples within a group"))
    per_device_train_batch_size: int = _f(8, "completions per device per micro-batch (times "
                                             "gradient_accumulation_steps: a multiple of num_generations)",
                                          rule=AT_LEAST_1)
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step", rule=AT_LEAST_1)
    max_completion_length: int = _f(256, "max new tokens per completion", rule=AT_LEAST_1)
    learning_rate: float = _f(1e-6, "AdamW learning rate (0 = the policy never moves)", rule=NON_NEGATIVE)
    max_steps: int = _f(100, "optimizer steps to run (-1 = run num_train_epochs)", rule=STEPS)
    num_train_epochs: float = _f(1.0, "epochs over the data when max_steps is -1", rule=POSITIVE)
    num_iterations: int = _f(1, "optimizer passes over each generated batch (mu in the GRPO paper)",
                             rule=AT_LEAST_1)
    temperature: float = _f(1.0, "sampling temperature of the rollouts (> 0: logprobs divide by it)",
                            rule=POSITIVE)
    top_p: float = _f(1.0, "nucleus sampling of the rollouts (1.0 = off)", rule=FRACTION)
    top_k: int = _f(0, "top-k sampling of the rollouts (0 = off)", rule=AT_LEAST_0)
    beta: float = _f(0.0, "KL coefficient against a reference model (0 = no reference model, cheaper; grpo: a loss "
                          "term, rloo: a penalty in the reward)", rule=NON_NEGATIVE)
    logging_steps: int = _f(1, "log metrics every this many steps", rule=AT_LEAST_1)
    save_steps: int = _f(10, "write a checkpoint every this many steps", rule=AT_LEAST_1)
    save_total_limit: int | None = _f(2, "keep at most this many checkpoints (None = keep all)", rule=AT_LEAST_1)
    activation_checkpointing: bool | None = _f(None, "recompute activations in backward to save memory (slower); "
                                                     "None = TRL's default (on)")
    log_completions: bool = _f(False, "log sampled completions to the console/W&B")
    extra: dict = _f(help="any other field of the trainer's TRL config (trl.GRPOConfig / trl.RLOOConfig), passed "
                          "through unchanged (checked against it when training starts)", factory=dict)


@dataclass
class GRPOSection(TRLSection):
    """Fields copied onto trl.GRPOConfig (same names and meaning); `extra` passes any other GRPOConfig field."""


@dataclass
class RLOOSection(TRLSection):
    """Fields copied onto trl.RLOOConfig (same names and meaning); `extra` passes any other RLOOConfig field."""

    normalize_advantages: bool = _f(False, "normalize the leave-one-out advantages over the batch")


@dataclass
class PPOSection(_Checked):
    """Fields copied onto trainers.ppo_config.PPOConfig (same names); `extra` passes any other PPOConfig field."""

    num_generations: int = _f(4, "completions sampled per prompt", rule=AT_LEAST_1)
    per_device_train_batch_size: int = _f(8, "completions per minibatch (one optimizer update)", rule=AT_LEAST_1)
    num_mini_batches: int = _f(1, "minibatches per rollout: a rollout is per_device_train_batch_size * "
                                  "num_mini_batches completions", rule=AT_LEAST_1)
    num_ppo_epochs: int = _f(4, "passes over each rollout batch", rule=AT_LEAST_1)
    max_completion_length: int = _f(128, "max new tokens per completion", rule=AT_LEAST_1)
    learning_rate: float = _f(1e-6, "AdamW learning rate of the policy (0 = the policy never moves)",
                              rule=NON_NEGATIVE)
    value_learning_rate: float | None = _f(1e-4, "learning rate of the value head/critic (None = learning_rate)",
                                           rule=NON_NEGATIVE)
    value_model: Literal["head", "separate"] = _f("head", "head: linear value head on the policy backbone; "
                                                          "separate: a critic copied from the policy's backbone")
    max_steps: int = _f(100, "training steps, one rollout + its PPO epochs each (-1 = run num_train_epochs)",
                        rule=STEPS)
    num_train_epochs: float = _f(1.0, "epochs over the data when max_steps is -1", rule=POSITIVE)
    temperature: float = _f(1.0, "sampling temperature of the rollouts (> 0: logprobs divide by it)", rule=POSITIVE)
    kl_coef: float = _f(0.0, "KL coefficient against the initial policy (0 = no reference model, cheaper)",
                        rule=NON_NEGATIVE)
    kl_estimator: Literal["k1", "k3"] = _f("k1", "per-token KL estimator")
    kl_in_reward: bool = _f(True, "KL as a per-token reward penalty (True) or a loss term (False)")
    cliprange: float = _f(0.2, "policy ratio clip epsilon", rule=POSITIVE)
    cliprange_value: float = _f(0.2, "value clip around the old values", rule=POSITIVE)
    vf_coef: float = _f(0.1, "value loss weight", rule=NON_NEGATIVE)
    gamma: float = _f(1.0, "GAE discount", rule=UNIT)
    lam: float = _f(0.95, "GAE lambda of the policy's advantages", rule=UNIT)
    value_lam: float | None = _f(None, "GAE lambda of the value targets (None = lam; 1.0 = VAPO's decoupled GAE: "
                                       "Monte Carlo returns, so the critic sees the outcome reward at every token)",
                                rule=UNIT)
    value_warmup_steps: int = _f(0, "first steps that train the value model only (verl's critic_warmup)",
                                 rule=AT_LEAST_0)
    whiten_rewards: bool = _f(False, "whiten per-token rewards before GAE")
    missing_eos_penalty: float | None = _f(None, "score penalty (subtracted) for completions cut at "
                                                 "max_completion_length", rule=NON_NEGATIVE)
    logging_steps: int = _f(1, "log metrics every this many steps", rule=AT_LEAST_1)
    save_steps: int = _f(10, "write a checkpoint (policy + value model) every this many steps", rule=AT_LEAST_1)
    save_total_limit: int | None = _f(2, "keep at most this many checkpoints (None = keep all)", rule=AT_LEAST_1)
    extra: dict = _f(help="any other PPOConfig / TrainingArguments field, passed through unchanged (checked when "
                          "training starts)", factory=dict)


@dataclass
class RolloutSection(_Checked):
    """Which rollout backend, and the engine's capacity."""

    backend: str = _f("engine", "what produces the rollouts (rollout/backend.py's registry): engine = rlspec's "
                                "in-process speculative engine; ray = `workers` engine replicas as Ray actors "
                                "(rollout/workers/, docs/workers.md; workers > 1 or a ray_address imply ray); "
                                "vllm = an in-process vLLM keeping rlspec's speculation policy and drafter "
                                "(needs the `make vllm-venv` environment, docs/vllm_backend.md)",
                     rule=registered("rollout backend (rollout/backend.py)", _backends))
    workers: int | None = _f(None, "ray: engine replicas (Ray actors): one GPU each on GPU clusters, else one CPU "
                                   "core each with one torch thread (None: one per GPU, else one per CPU of the "
                                   "cluster)", rule=AT_LEAST_1)
    ray_address: str | None = _f(None, "ray: the cluster to join (\"auto\" = the one `ray start --head` made on this "
                                       "machine, or host:port); None starts a local Ray",
                                 rule=NON_EMPTY)
    groups_per_task: int = _f(1, "ray: prompt groups (a prompt's n samples) per task a worker pulls from the queue. "
                                 "1 spreads the long tail best; on GPUs raise it until a task fills a decode batch "
                                 "(a worker runs one task at a time). The seed reproduces rollouts for a given value, "
                                 "whatever the number of workers", rule=AT_LEAST_1)
    worker_threads: int | None = _f(None, "ray: torch threads per worker (None: 1 on CPU workers, torch's default "
                                          "on GPU workers)", rule=AT_LEAST_1)
    drafter_trainer: Literal["spot", "dedicated"] = _f(
        "spot", "ray + eagle3/auto with online training: where the run's one drafter trains. spot: on the cycles "
                "of workers whose share of the batch is done (TLT), reserving nothing; dedicated: an actor with "
                "a CPU (or drafter_trainer_gpus) of its own, training all the time")
    drafter_trainer_gpus: float = _f(0.0, "ray, dedicated drafter trainer: GPUs it reserves (0: it trains on a CPU)",
                                     rule=NON_NEGATIVE)
    task_deadline_multiple: float = _f(5.0, "ray: a task running longer than this multiple of the slowest recent "
                                            "task (and task_deadline_floor_s) counts its worker as stuck: the worker "
                                            "is killed and replaced and the task re-run (the same samples)",
                                       rule=at_least(1))
    task_deadline_floor_s: float = _f(30.0, "ray: the shortest deadline of a task, in seconds", rule=POSITIVE)
    task_deadline_first_s: float = _f(300.0, "ray: a task's deadline before any task was timed (the first rollout "
                                             "compiles and warms up), in seconds", rule=POSITIVE)

    max_model_len: int = _f(2048, "prompt + completion tokens the engine's KV cache holds per sequence",
                            rule=at_least(2))
    max_num_seqs: int = _f(64, "sequences decoded at once; larger batches are split", rule=AT_LEAST_1)
    graph_mode: Literal["auto", "off", "lazy", "eager_start"] = _f(
        "auto", "CUDA graphs for decode/verify steps (GPU only; CPU always runs eagerly): auto (= lazy), off, "
                "lazy (capture each batch/draft shape when first needed) or eager_start (capture every shape, "
                "largest first, when the engine allocates its KV cache)")
    compile: Literal["auto", "on", "off"] = _f(
        "auto", "compiled decode steps (rollout/runtime/compiled.py): auto compiles where it was measured to pay "
                "(CPU bf16: batch-1 steps; compiled once per machine, cached under $RLSPEC_CACHE/inductor), on "
                "compiles every step (inside the CUDA graphs on a GPU), off runs every step eagerly")
    kv_memory_gb: float | None = _f(None, "GiB of KV cache (every layer, K and V, the drafter's layer included); "
                                          "the pool holds fixed-size blocks that follow the tokens actually generated. "
                                          "None: kv_memory_fraction, or else what max_num_seqs x max_model_len could "
                                          "use, capped at 90% of free memory", rule=POSITIVE)
    kv_memory_fraction: float | None = _f(None, "share (0, 1] of the device's free memory (host RAM on CPU) for the "
                                                "KV cache when kv_memory_gb is not set", rule=FRACTION)
    kv_block_size: int = _f(16, "positions per KV block (on CUDA a divisor of 128, FlexAttention's block)",
                            rule=AT_LEAST_1)
    free_kv_between_rollouts: bool | None = _f(None, "hand the KV cache back after every rollout so the policy "
                                                     "update has the memory (None: on for CUDA, off on CPU)")
    keep_kv_fraction: float = _f(0.25, "CUDA: a KV pool with CUDA graphs over it stays across rollouts while pool "
                                       "and graphs take at most this share [0, 1] of the device's memory, so the "
                                       "graphs are not captured again every rollout; 0 gives every pool back "
                                       "(docs/runtime.md#graphs-across-rollouts)", rule=UNIT)
    sync_bucket_mb: float = _f(512.0, "weight sync under DeepSpeed ZeRO-3: the most megabytes (full size) of "
                                      "parameters one collective gather brings in; larger = fewer, bigger gathers "
                                      "(transient memory per process grows with it)", rule=POSITIVE)

    def engine_kwargs(self) -> dict[str, Any]:
        """What the trainer hands its rollout source (`engine_kwargs`): the backend, the engine's capacity and
        KV settings, the sync bucket, and the ray backend's own settings when it is the backend."""
        return dict(backend=self.backend, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                    graph_mode=self.graph_mode, compile_mode=self.compile, kv_memory_gb=self.kv_memory_gb,
                    kv_memory_fraction=self.kv_memory_fraction, kv_block_size=self.kv_block_size,
                    free_kv_between_rollouts=self.free_kv_between_rollouts, keep_kv_fraction=self.keep_kv_fraction,
                    sync_bucket_mb=self.sync_bucket_mb,
                    **self.pool_kwargs())

    def pool_kwargs(self) -> dict[str, Any]:
        """The ray backend's own settings (empty for other backends, whose factories do not take them)."""
        if self.backend != "ray":
            return {}
        return dict(workers=self.workers, ray_address=self.ray_address, groups_per_task=self.groups_per_task,
                    worker_threads=self.worker_threads, drafter_trainer=self.drafter_trainer,
                    drafter_trainer_gpus=self.drafter_trainer_gpus, task_deadline_multiple=self.task_deadline_multiple,
                    task_deadline_floor_s=self.task_deadline_floor_s, task_deadline_first_s=self.task_deadline_first_s)


@dataclass
class DrafterSection(SpecConfig):
    """Speculative decoding inside the engine, lossless at any temperature: the engine's SpecConfig
    (same fields, same validation), plus what the run does with a learned drafter."""

    export: bool = _f(True, "eagle3: export the drafter to <output_dir>/drafter at the end of the run (and on a "
                            "crash), in the EAGLE-3 format vLLM and SGLang load")
    warm_start_s: float = _f(180.0, "eagle3/auto: seconds of drafter warm-up before the first RL step, on the "
                                    "target's own rollouts of the run's prompts (0 = off; skipped when "
                                    "drafter_path is set). Cached under $RLSPEC_CACHE/drafters keyed by the "
                                    "target's weights: a later run of the same model loads it in a second",
                                  rule=NON_NEGATIVE)
    warm_start_prompts: int = _f(64, "eagle3/auto: how many of the run's prompts the warm-up samples",
                                 rule=AT_LEAST_1)

    # the SpecConfig fields' rules are declared on SpecConfig (rollout/types.py) and checked by its __post_init__,
    # for the Python API and this section alike; a run config's drafter comes from disk, so it must exist
    RULES: ClassVar[dict[str, Rule]] = dict(drafter_path=DIRECTORY)


@dataclass
class PartialRolloutsSection(_Checked):
    """Partial rollouts for GRPO (docs/partial_rollouts.md): a step trains on the groups that finish first and
    carries unfinished samples into the next generation round. Off by default."""

    enabled: bool = _f(False, "over-provision each generation round and carry unfinished samples on (grpo only, "
                              "rollout.backend=engine, one process)")
    oversample: float = _f(1.0, "groups in flight beyond those a round trains on, as a fraction of them",
                           rule=Rule("a number in (0, 8]", lambda v: isinstance(v, (int, float)) and 0 < v <= 8))
    max_staleness: int = _f(4, "most optimizer steps between the policy that sampled a token and the step that "
                               "trains on it; a round runs at least max_completion_length / (max_staleness + 1) "
                               "decode steps so samples finish in time", rule=AT_LEAST_1)


@dataclass
class WandbSection(_Checked):
    """Weights & Biases logging."""

    project: str = _f("rlspec", "W&B project name", rule=NON_EMPTY)
    mode: Literal["offline", "online", "disabled"] = _f(
        "offline", "offline writes runs locally (sync later with `wandb sync`); online needs a login; "
                   "disabled turns W&B off. The WANDB_MODE env var wins.")
    run_name: str | None = _f(None, "run name (None = the output_dir's name)", rule=NON_EMPTY)
    dir: str | None = _f(None, "where W&B writes runs (None = <output_dir>/wandb)", rule=NON_EMPTY)
