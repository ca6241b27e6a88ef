"""Run configuration: one dataclass per YAML section, strict loading, `key=value` overrides.

`load_config("grpo_math.yaml", ["grpo.max_steps=3"])` reads a YAML recipe, applies dotted
overrides and checks every key and type against the dataclasses below. Mistakes fail early, before
torch is imported, with a `ConfigError` that names the nearest valid key, the expected type or the
valid choices. Keep this module free of heavy imports: the CLI parses its config first.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from rollout.types import SpecConfig  # plain dataclasses, no torch


class ConfigError(ValueError):
    """A config file or override is wrong; the message says what and how to fix it."""


def _f(default: Any = None, help: str = "", factory: Any = None) -> Any:
    """A dataclass field carrying its help string (shown by `python -m rlspec.train --help`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    """Which prompts to train on."""

    name: str = _f("embedded_math", "'embedded_math' (generated arithmetic, no download) or a hub dataset id "
                                    "such as 'openai/gsm8k'")
    subset: str | None = _f(None, "hub dataset config name, e.g. 'main' for openai/gsm8k")
    split: str = _f("train", "dataset split to train on")
    num_examples: int | None = _f(None, "keep this many examples (None = all; embedded_math then generates 256)")
    max_operand: int = _f(9, "embedded_math: largest operand (9 = single-digit problems, on which "
                             "SmolLM2-135M earns a mean reward of ~0.25)")
    ops: list[str] = _f(help="embedded_math: operators to draw from (+, -, *)", factory=lambda: ["+"])
    seed: int = _f(0, "seed for generating/shuffling the data")
    extra: dict = _f(help="other keyword arguments of trainers.data.load_dataset_by_name (e.g. question_column)",
                     factory=dict)


@dataclass
class GRPOSection:
    """Fields copied onto trl.GRPOConfig (same names and meaning); `extra` passes any other GRPOConfig field."""

    num_generations: int = _f(8, "completions sampled per prompt (the group size G)")
    per_device_train_batch_size: int = _f(8, "completions per device per micro-batch (times "
                                             "gradient_accumulation_steps: a multiple of num_generations)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    max_completion_length: int = _f(256, "max new tokens per completion")
    learning_rate: float = _f(1e-6, "AdamW learning rate")
    max_steps: int = _f(100, "optimizer steps to run (-1 = run num_train_epochs)")
    num_train_epochs: float = _f(1.0, "epochs over the data when max_steps is -1")
    num_iterations: int = _f(1, "optimizer passes over each generated batch (mu in the GRPO paper)")
    temperature: float = _f(1.0, "sampling temperature of the rollouts")
    top_p: float = _f(1.0, "nucleus sampling of the rollouts (1.0 = off)")
    top_k: int = _f(0, "top-k sampling of the rollouts (0 = off)")
    beta: float = _f(0.0, "KL coefficient against a reference model (0 = no reference model, cheaper)")
    logging_steps: int = _f(1, "log metrics every this many steps")
    save_steps: int = _f(10, "write a checkpoint every this many steps")
    save_total_limit: int | None = _f(2, "keep at most this many checkpoints (None = keep all)")
    activation_checkpointing: bool | None = _f(None, "recompute activations in backward to save memory (slower); "
                                                     "None = TRL's default (on)")
    log_completions: bool = _f(False, "log sampled completions to the console/W&B")
    extra: dict = _f(help="any other trl.GRPOConfig field, passed through unchanged (checked against GRPOConfig "
                          "when training starts)", factory=dict)


@dataclass
class PPOSection:
    """Fields copied onto trainers.ppo_config.PPOConfig (same names); `extra` passes any other PPOConfig field."""

    num_generations: int = _f(4, "completions sampled per prompt")
    per_device_train_batch_size: int = _f(8, "completions per minibatch (one optimizer update)")
    num_mini_batches: int = _f(1, "minibatches per rollout: a rollout is per_device_train_batch_size * "
                                  "num_mini_batches completions")
    num_ppo_epochs: int = _f(4, "passes over each rollout batch")
    max_completion_length: int = _f(128, "max new tokens per completion")
    learning_rate: float = _f(1e-6, "AdamW learning rate of the policy")
    value_learning_rate: float | None = _f(1e-4, "learning rate of the value head/critic (None = learning_rate)")
    value_model: Literal["head", "separate"] = _f("head", "head: linear value head on the policy backbone; "
                                                          "separate: a critic copied from the policy's backbone")
    max_steps: int = _f(100, "training steps, one rollout + its PPO epochs each (-1 = run num_train_epochs)")
    num_train_epochs: float = _f(1.0, "epochs over the data when max_steps is -1")
    temperature: float = _f(1.0, "sampling temperature of the rollouts")
    kl_coef: float = _f(0.0, "KL coefficient against the initial policy (0 = no reference model, cheaper)")
    kl_estimator: Literal["k1", "k3"] = _f("k1", "per-token KL estimator")
    kl_in_reward: bool = _f(True, "KL as a per-token reward penalty (True) or a loss term (False)")
    cliprange: float = _f(0.2, "policy ratio clip epsilon")
    cliprange_value: float = _f(0.2, "value clip around the old values")
    vf_coef: float = _f(0.1, "value loss weight")
    gamma: float = _f(1.0, "GAE discount")
    lam: float = _f(0.95, "GAE lambda of the policy's advantages")
    value_lam: float | None = _f(None, "GAE lambda of the value targets (None = lam; 1.0 = VAPO's decoupled GAE: "
                                       "Monte Carlo returns, so the critic sees the outcome reward at every token)")
    value_warmup_steps: int = _f(0, "first steps that train the value model only (verl's critic_warmup)")
    whiten_rewards: bool = _f(False, "whiten per-token rewards before GAE")
    missing_eos_penalty: float | None = _f(None, "score penalty for completions cut at max_completion_length")
    logging_steps: int = _f(1, "log metrics every this many steps")
    save_steps: int = _f(10, "write a checkpoint (policy + value model) every this many steps")
    save_total_limit: int | None = _f(2, "keep at most this many checkpoints (None = keep all)")
    extra: dict = _f(help="any other PPOConfig / TrainingArguments field, passed through unchanged (checked when "
                          "training starts)", factory=dict)


@dataclass
class RolloutSection:
    """Which rollout backend, and the engine's capacity."""

    backend: str = _f("engine", "what produces the rollouts (rollout/backend.py's registry): engine = rlspec's "
                                "in-process speculative engine; ray = `workers` engine replicas as Ray actors "
                                "(rollout/workers/, docs/workers.md; workers > 1 or a ray_address imply ray); "
                                "vllm = an in-process vLLM keeping rlspec's speculation policy and drafter "
                                "(needs the `make vllm-venv` environment, docs/vllm_backend.md)")
    workers: int | None = _f(None, "ray: engine replicas (Ray actors): one GPU each on GPU clusters, else one CPU "
                                   "core each with one torch thread (None: one per GPU, else one per CPU of the "
                                   "cluster)")
    ray_address: str | None = _f(None, "ray: the cluster to join (\"auto\" = the one `ray start --head` made on this "
                                       "machine, or host:port); None starts a local Ray")
    groups_per_task: int = _f(1, "ray: prompt groups (a prompt's n samples) per task a worker pulls from the queue. "
                                 "1 spreads the long tail best; on GPUs raise it until a task fills a decode batch "
                                 "(a worker runs one task at a time). The seed reproduces rollouts for a given value, "
                                 "whatever the number of workers")
    worker_threads: int | None = _f(None, "ray: torch threads per worker (None: 1 on CPU workers, torch's default "
                                          "on GPU workers)")
    drafter_trainer: Literal["spot", "dedicated"] = _f(
        "spot", "ray + eagle3/auto with online training: where the run's one drafter trains. spot: on the cycles "
                "of workers whose share of the batch is done (TLT), reserving nothing; dedicated: an actor with "
                "a CPU (or drafter_trainer_gpus) of its own, training all the time")
    drafter_trainer_gpus: float = _f(0.0, "ray, dedicated drafter trainer: GPUs it reserves (0: it trains on a CPU)")

    max_model_len: int = _f(2048, "prompt + completion tokens the engine's KV cache holds per sequence")
    max_num_seqs: int = _f(64, "sequences decoded at once; larger batches are split")
    graph_mode: Literal["auto", "off", "lazy", "eager_start"] = _f(
        "auto", "CUDA graphs for decode/verify steps (GPU only; CPU always runs eagerly): auto (= lazy), off, "
                "lazy (capture each batch/draft shape when first needed) or eager_start (capture every shape, "
                "largest first, when the engine allocates its KV cache)")
    kv_memory_gb: float | None = _f(None, "GiB of KV cache (every layer, K and V, the drafter's layer included); "
                                          "the pool holds fixed-size blocks that follow the tokens actually generated. "
                                          "None: kv_memory_fraction, or else what max_num_seqs x max_model_len could "
                                          "use, capped at 90% of free memory")
    kv_memory_fraction: float | None = _f(None, "share (0, 1] of the device's free memory (host RAM on CPU) for the "
                                                "KV cache when kv_memory_gb is not set")
    kv_block_size: int = _f(16, "positions per KV block (on CUDA a divisor of 128, FlexAttention's block)")
    free_kv_between_rollouts: bool | None = _f(None, "hand the KV cache back after every rollout so the policy "
                                                     "update has the memory (None: on for CUDA, off on CPU)")
    sync_bucket_mb: float = _f(512.0, "weight sync under DeepSpeed ZeRO-3: the most megabytes (full size) of "
                                      "parameters one collective gather brings in; larger = fewer, bigger gathers "
                                      "(transient memory per process grows with it)")

    def engine_kwargs(self) -> dict[str, Any]:
        """What the trainer hands its rollout source (`engine_kwargs`): the backend, the engine's capacity and
        KV settings, the sync bucket, and the ray backend's own settings when it is the backend."""
        return dict(backend=self.backend, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                    graph_mode=self.graph_mode, kv_memory_gb=self.kv_memory_gb,
                    kv_memory_fraction=self.kv_memory_fraction, kv_block_size=self.kv_block_size,
                    free_kv_between_rollouts=self.free_kv_between_rollouts, sync_bucket_mb=self.sync_bucket_mb,
                    **self.pool_kwargs())

    def pool_kwargs(self) -> dict[str, Any]:
        """The ray backend's own settings (empty for other backends, whose factories do not take them)."""
        if self.backend != "ray":
            return {}
        return dict(workers=self.workers, ray_address=self.ray_address, groups_per_task=self.groups_per_task,
                    worker_threads=self.worker_threads, drafter_trainer=self.drafter_trainer,
                    drafter_trainer_gpus=self.drafter_trainer_gpus)


@dataclass
class DrafterSection(SpecConfig):
    """Speculative decoding inside the engine, lossless at any temperature: the engine's SpecConfig
    (same fields, same validation), plus what the run does with a learned drafter."""

    export: bool = _f(True, "eagle3: export the drafter to <output_dir>/drafter at the end of the run (and on a "
                            "crash), in the EAGLE-3 format vLLM and SGLang load")
    warm_start_s: float = _f(180.0, "eagle3/auto: seconds of drafter warm-up before the first RL step, on the "
                                    "target's own rollouts of the run's prompts (0 = off; skipped when "
                                    "drafter_path is set). Cached under $RLSPEC_CACHE/drafters keyed by the "
                                    "target's weights: a later run of the same model loads it in a second")
    warm_start_prompts: int = _f(64, "eagle3/auto: how many of the run's prompts the warm-up samples")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warm_start_s < 0:
            raise ValueError(f"warm_start_s must be >= 0 seconds (0 turns warm-up off), got {self.warm_start_s}")
        if self.warm_start_prompts < 1:
            raise ValueError(f"warm_start_prompts must be >= 1, got {self.warm_start_prompts}")


@dataclass
class WandbSection:
    """Weights & Biases logging."""

    project: str = _f("rlspec", "W&B project name")
    mode: Literal["offline", "online", "disabled"] = _f(
        "offline", "offline writes runs locally (sync later with `wandb sync`); online needs a login; "
                   "disabled turns W&B off. The WANDB_MODE env var wins.")
    run_name: str | None = _f(None, "run name (None = the output_dir's name)")
    dir: str | None = _f(None, "where W&B writes runs (None = <output_dir>/wandb)")


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
# Loading


CONFIG_DIRS_ENV = "RLSPEC_CONFIG_DIR"  # extra place to look for recipes by name


def load_config(path_or_name: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (a path, or a name found in configs/), apply `key=value` overrides, validate.

    With no path the defaults of the dataclasses are used (plus overrides).
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path_or_name:
        path = resolve_config_path(path_or_name)
        source = str(path)
        raw = _read_yaml(path)
    for text in overrides or []:
        _apply_override(raw, text)
    return build(Config, raw, source)


def config_search_dirs() -> list[Path]:
    """Where a recipe named without a directory is looked for, in order."""
    dirs = [Path.cwd(), Path.cwd() / "configs"]
    if os.environ.get(CONFIG_DIRS_ENV):
        dirs.insert(0, Path(os.environ[CONFIG_DIRS_ENV]))
    dirs.append(Path(__file__).resolve().parent.parent / "configs")  # the repo's configs/ (source checkout)
    dirs.append(Path(__file__).resolve().parent / "configs")  # packaged recipes, if installed as data
    return list(dict.fromkeys(dirs))


def resolve_config_path(path_or_name: str) -> Path:
    """An existing path as given, else the name (with .yaml added if missing) in config_search_dirs()."""
    given = Path(path_or_name).expanduser()
    names = [given] if given.suffix in (".yaml", ".yml") else [given, given.with_name(given.name + ".yaml")]
    tried: list[Path] = []
    for name in names:
        candidates = [name] if name.is_absolute() else [name] + [d / name for d in config_search_dirs()]
        for cand in candidates:
            tried.append(cand)
            if cand.is_file():
                return cand
    looked = "\n  ".join(str(p) for p in dict.fromkeys(tried))
    raise ConfigError(
        f"config file {path_or_name!r} not found. Looked in:\n  {looked}\n"
        f"Pass an existing path, a name from configs/ (e.g. config=grpo_math.yaml), or set {CONFIG_DIRS_ENV}."
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _apply_override(raw: dict[str, Any], text: str) -> None:
    """Set one dotted `key=value` into the raw dict, checking the key against the schema first."""
    key, sep, value_text = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not key=value (e.g. grpo.max_steps=3 or drafter.drafter=suffix)")
    parts = key.split(".")
    where = f"override {text!r}"
    tp = _schema_type(parts, where)
    value = _parse_override_value(value_text, tp)
    if tp is not Any:
        value = _coerce(value, tp, key, where)  # type errors name the override, not the file
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[parts[-1]] = value


def _schema_type(parts: list[str], where: str) -> Any:
    """The declared type at a dotted key; keys below a free-form dict field are accepted as Any."""
    cls: Any = Config
    for i, p in enumerate(parts):
        hints = _hints(cls)
        if p not in hints:
            section = ".".join(parts[:i]) or None
            raise ConfigError(_unknown_key_message(p, list(hints), section, where))
        tp = hints[p]
        if _is_dataclass_type(tp):
            cls = tp
            continue
        if _base(tp) is dict:
            return tp if i == len(parts) - 1 else Any  # free-form below a dict field (grpo.extra.<any>)
        if i != len(parts) - 1:
            name = ".".join(parts[: i + 1])
            raise ConfigError(f"{where}: {name} has type {_type_name(tp)}, not a section; it has no sub-keys")
        return tp
    example = f"{'.'.join(parts)}.{next(iter(_hints(cls)))}=..."
    raise ConfigError(f"{where}: {'.'.join(parts)} is a section; set one of its keys (e.g. {example})")


def _parse_override_value(text: str, tp: Any) -> Any:
    """Parse as a YAML scalar, except that string fields take the text verbatim (run_name=123 stays '123')."""
    text = text.strip()
    wants_str = _base(tp) is str or (get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp)))
    if wants_str and text not in ("null", "None", "~"):
        return text
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


# ---------------------------------------------------------------------------------------------
# Validation


def build(cls: Any, raw: Any, source: str, prefix: str = "") -> Any:
    """Construct dataclass `cls` from a raw mapping, checking keys and types (recursing into sections)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix or 'config'} must be a mapping of keys, got {type(raw).__name__} {raw!r}")
    hints = _hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(_unknown_key_message(str(key), list(hints), prefix or None, source))
        name = f"{prefix}.{key}" if prefix else str(key)
        kwargs[key] = _coerce(value, hints[key], name, source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except ValueError as e:  # a section's own validation (e.g. SpecConfig: an unknown drafter)
        raise ConfigError(f"{source}: {prefix + '.' if prefix else ''}{e}") from None


def _coerce(value: Any, tp: Any, name: str, source: str) -> Any:
    if _is_dataclass_type(tp):
        return build(tp, {} if value is None else value, source, name)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {name} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (Union, _UnionType) and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name, source)
    if origin is list:
        if isinstance(value, str):
            value = [value]  # rewards=accuracy on the command line means a one-item list
        if not isinstance(value, list):
            raise _type_error(name, tp, value, source)
        return [_coerce(v, args[0], f"{name}[{i}]", source) for i, v in enumerate(value)] if args else value
    return _coerce_scalar(value, _base(tp), name, source, tp)


def _coerce_scalar(value: Any, base: Any, name: str, source: str, tp: Any) -> Any:
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        if isinstance(value, str):
            # YAML 1.1 reads `1e-6` (no dot) as a string; accept it as the float the user meant.
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base is str:
        ok = isinstance(value, str)
    elif base is dict:
        ok = isinstance(value, dict)
        value = dict(value) if ok else value
    else:
        ok = True
    if not ok:
        raise _type_error(name, tp, value, source)
    return value


def _type_error(name: str, tp: Any, value: Any, source: str) -> ConfigError:
    return ConfigError(f"{source}: {name} expects {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _unknown_key_message(key: str, valid: list[str], section: str | None, where: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    full = f"{section}.{key}" if section else key
    place = f"in section '{section}'" if section else "at the top level"
    hint = f" Did you mean '{section + '.' if section else ''}{close[0]}'?" if close else ""
    return f"{where}: unknown key '{full}' {place}.{hint} Valid keys {place}: {', '.join(valid)}."


def _check_cross_fields(cfg: Config) -> None:
    """Checks that span fields; raised as ConfigError by build() with the source prepended."""
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


# ---------------------------------------------------------------------------------------------
# Type helpers and --help


_UnionType = type(int | None)


def _hints(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _base(tp: Any) -> Any:
    """Strip Optional[...] and generics: `int | None` -> int, `dict[str, Any]` -> dict."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, _UnionType):
        inner = [a for a in args if a is not type(None)]
        return _base(inner[0]) if len(inner) == 1 else tp
    return origin or tp


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, _UnionType):
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def format_help(cls: Any = Config, prefix: str = "") -> str:
    """Every key with its type, default and help string, one per line (for `--help`)."""
    lines = []
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(tp):
            lines.append(f"\n[{name}] {f.metadata.get('help', '')}")
            lines.append(format_help(tp, name + "."))
            continue
        default = getattr(defaults, f.name)
        lines.append(f"  {name} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}")
    return "\n".join(lines)
