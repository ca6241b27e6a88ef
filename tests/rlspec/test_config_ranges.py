"""Every config field's allowed values, checked before torch is imported (rlspec/config/ranges.py).

One table row per field of every section: a value the run can use loads, a value it cannot is refused
with a ConfigError naming the key, both as a `key=value` override and written in a YAML file. A test
keeps the table covering every field, so a new field comes with its row.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlspec.config import Config, ConfigError, load_config
from rlspec.config.ranges import MATH_OPS

REPO = Path(__file__).resolve().parents[2]
LOSSY = {"drafter.accept_off_policy": True, "drafter.drafter": "suffix"}

# key: (a valid value, a bad value[, other keys the valid value needs])
CASES: dict[str, tuple[Any, ...]] = {
    "trainer": ("ppo", "sac"),
    "model": ("gpt2", ""),
    "dtype": ("float32", "float16"),
    "seed": (7, -1),
    "output_dir": ("outputs/elsewhere", ""),
    "resume": ("auto", ""),
    "overwrite_output_dir": (True, "maybe"),
    "on_nonfinite": ("skip_batch", "ignore"),
    "rewards": (["accuracy", "format"], ["acuracy"]),
    "partial_rollouts.enabled": (True, "sometimes"),
    "partial_rollouts.oversample": (0.5, 0),
    "partial_rollouts.max_staleness": (2, 0),
    "data.name": ("openai/gsm8k", ""),
    "data.subset": ("main", ""),
    "data.split": ("test", ""),
    "data.num_examples": (64, -3),
    "data.max_operand": (99, 0),
    "data.ops": (["+", "*"], ["/"]),
    "data.seed": (3, -1),
    "data.drop_long_prompts": (True, "maybe"),
    "data.extra": ({"question_column": "q"}, {"split": "test"}),
    "grpo.num_generations": (4, 1),
    "grpo.per_device_train_batch_size": (16, 0),
    "grpo.gradient_accumulation_steps": (2, 0),
    "grpo.max_completion_length": (64, 0),
    "grpo.learning_rate": (0.0, float("nan")),
    "grpo.max_steps": (-1, 0),
    "grpo.num_train_epochs": (2.0, 0.0),
    "grpo.num_iterations": (2, 0),
    "grpo.temperature": (0.7, 0.0),
    "grpo.top_p": (0.9, 0.0),
    "grpo.top_k": (50, -1),
    "grpo.beta": (0.04, -1.0),
    "grpo.logging_steps": (5, 0),
    "grpo.save_steps": (5, 0),
    "grpo.save_total_limit": (None, 0),
    "grpo.activation_checkpointing": (True, "maybe"),
    "grpo.log_completions": (True, "maybe"),
    "grpo.extra": ({"warmup_steps": 2}, {"output_dir": "elsewhere"}),
    "ppo.num_generations": (2, 0),
    "ppo.per_device_train_batch_size": (16, 0),
    "ppo.num_mini_batches": (2, 0),
    "ppo.num_ppo_epochs": (1, 0),
    "ppo.max_completion_length": (64, 0),
    "ppo.learning_rate": (1e-5, -1.0),
    "ppo.value_learning_rate": (None, float("nan")),
    "ppo.value_model": ("separate", "shared"),
    "ppo.max_steps": (-1, 0),
    "ppo.num_train_epochs": (2.0, float("inf")),
    "ppo.temperature": (0.7, 0.0),
    "ppo.kl_coef": (0.1, -0.1),
    "ppo.kl_estimator": ("k3", "k2"),
    "ppo.kl_in_reward": (False, "maybe"),
    "ppo.cliprange": (0.1, 0.0),
    "ppo.cliprange_value": (0.3, 0.0),
    "ppo.vf_coef": (0.5, -1.0),
    "ppo.gamma": (0.99, 1.5),
    "ppo.lam": (1.0, -0.1),
    "ppo.value_lam": (1.0, 2.0),
    "ppo.value_warmup_steps": (3, -1),
    "ppo.whiten_rewards": (True, "maybe"),
    "ppo.missing_eos_penalty": (1.0, -1.0),
    "ppo.logging_steps": (2, 0),
    "ppo.save_steps": (2, 0),
    "ppo.save_total_limit": (3, 0),
    "ppo.extra": ({"max_grad_norm": 1.0}, {"seed": 3}),
    "rollout.backend": ("ray", "vlm"),
    "rollout.workers": (2, 0),
    "rollout.ray_address": ("auto", ""),
    "rollout.groups_per_task": (2, 0),
    "rollout.worker_threads": (1, 0),
    "rollout.drafter_trainer": ("dedicated", "both"),
    "rollout.drafter_trainer_gpus": (0.5, -1.0),
    "rollout.task_deadline_multiple": (3.0, 0.5),
    "rollout.task_deadline_floor_s": (10.0, 0.0),
    "rollout.task_deadline_first_s": (60.0, -1.0),
    "rollout.max_model_len": (4096, 0),
    "rollout.max_num_seqs": (8, 0),
    "rollout.graph_mode": ("off", "always"),
    "rollout.compile": ("on", "maybe"),
    "rollout.kv_memory_gb": (2.5, 0.0),
    "rollout.kv_memory_fraction": (0.5, 5.0),
    "rollout.kv_block_size": (32, 0),
    "rollout.free_kv_between_rollouts": (True, "maybe"),
    "rollout.keep_kv_fraction": (0.0, 1.5),
    "rollout.sync_bucket_mb": (64.0, 0.0),
    "drafter.drafter": ("suffix", "medusa"),
    "drafter.num_draft_tokens": (3, 0),
    "drafter.tree_width": (2, 0),
    "drafter.selector": ("adaptive", "greedy"),
    "drafter.drafter_path": (str(REPO / "configs"), str(REPO / "no_such_drafter")),
    "drafter.max_spec_batch": (8, 0),
    "drafter.online_training": (False, "sometimes"),
    "drafter.draft_vocab_size": (1024, 0),
    "drafter.online_trainer": ("thread", "fork"),
    "drafter.trainer_threads": (2, 0),
    "drafter.trainer_device": ("cuda:1", "gpu one"),
    "drafter.verification": ("judge", "lossy", LOSSY),
    "drafter.judge": ("typical", "vibes"),
    "drafter.judge_threshold": (0.5, 0.0),
    "drafter.step_routing": ("arbitrage", "on", LOSSY),
    "drafter.router": ("learned", "oracle", {"drafter.route_threshold": 0.5}),
    "drafter.route_threshold": (-0.5, float("nan")),
    "drafter.step_delimiter": ("###", ""),
    "drafter.step_source": ("suffix", "gpt4"),
    "drafter.step_max_tokens": (16, 0),
    "drafter.accept_off_policy": (True, "maybe"),
    "drafter.export": (False, "maybe"),
    "drafter.warm_start_s": (0.0, float("nan")),
    "drafter.warm_start_prompts": (8, 0),
    "wandb.project": ("p", ""),
    "wandb.mode": ("disabled", "cloud"),
    "wandb.run_name": ("r", ""),
    "wandb.dir": ("/tmp/wandb", ""),
}
# the rloo section shares the grpo section's fields (TRLSection) and their rules
CASES.update({f"rloo.{k.removeprefix('grpo.')}": v for k, v in list(CASES.items()) if k.startswith("grpo.")})
CASES["rloo.normalize_advantages"] = (True, "maybe")


def leaf_keys(cls: Any = Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            keys += leaf_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def override(key: str, value: Any) -> str:
    """`key=value` as typed on the command line (strings verbatim, the rest as YAML flow)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def yaml_file(tmp_path: Path, settings: dict[str, Any]) -> str:
    nested: dict[str, Any] = {}
    for key, value in settings.items():
        *sections, name = key.split(".")
        node = nested
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(nested))
    return str(path)


def get(cfg: Config, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_table_covers_every_field():
    assert sorted(CASES) == sorted(leaf_keys()), "add a (valid, bad) row for each new config field"


@pytest.mark.parametrize("key", sorted(CASES))
def test_valid_value_loads(key, tmp_path):
    valid, _, *rest = CASES[key]
    others = rest[0] if rest else {}
    from_override = load_config(None, [override(k, v) for k, v in {**others, key: valid}.items()])
    from_file = load_config(yaml_file(tmp_path, {**others, key: valid}), [])
    assert get(from_override, key) == valid and get(from_file, key) == valid


@pytest.mark.parametrize("key", sorted(CASES))
def test_bad_value_is_refused_naming_the_key(key, tmp_path):
    _, bad, *_ = CASES[key]
    for how, load in (("override", lambda: load_config(None, [override(key, bad)])),
                      ("file", lambda: load_config(yaml_file(tmp_path, {key: bad}), []))):
        with pytest.raises(ConfigError) as err:
            load()
        assert key in str(err.value), f"{how}: {err.value}"


def test_override_errors_name_the_override_value_and_range():
    with pytest.raises(ConfigError) as err:
        load_config("grpo_math.yaml", ["grpo.per_device_train_batch_size=0"])
    assert str(err.value) == ("override 'grpo.per_device_train_batch_size=0': grpo.per_device_train_batch_size "
                              "must be >= 1, got 0")
    with pytest.raises(ConfigError, match=r"grpo.learning_rate must be a finite number >= 0, got nan"):
        load_config("grpo_math.yaml", ["grpo.learning_rate=nan"])
    with pytest.raises(ConfigError, match=r"rollout.kv_memory_fraction must be in \(0, 1\], got 5.0"):
        load_config("grpo_math.yaml", ["rollout.kv_memory_fraction=5"])


def test_misspelt_reward_names_the_nearest_registered_one():
    from rlspec.trainers.rewards import REWARD_FUNCS

    valid = ", ".join(sorted(REWARD_FUNCS))  # the live registry: a reward registered later counts too
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rewards=[accuracy,fromat]"])
    assert str(err.value) == (f"override 'rewards=[accuracy,fromat]': rewards must be a non-empty list of distinct "
                              f"reward functions (trainers/rewards.py): {valid}, got ['accuracy', 'fromat']: 'fromat' "
                              "is not one; did you mean 'format'?")
    with pytest.raises(ConfigError, match="'accuracy' is named twice"):
        load_config(None, ["rewards=[accuracy,accuracy]"])
    with pytest.raises(ConfigError, match="got \\[\\]: name at least one"):
        load_config(None, ["rewards=[]"])


def test_embedded_math_ops_are_the_datasets_templates():
    from rlspec.trainers.data import _TEMPLATES

    assert sorted(MATH_OPS) == sorted(_TEMPLATES)


@pytest.mark.parametrize("key, first_class", [
    ("grpo.extra.output_dir", "output_dir"), ("grpo.extra.seed", "seed"), ("grpo.extra.run_name", "wandb.run_name"),
    ("grpo.extra.bf16", "dtype"), ("grpo.extra.resume_from_checkpoint", "resume"),
    ("grpo.extra.max_steps", "grpo.max_steps"), ("grpo.extra.gradient_checkpointing", "grpo.activation_checkpointing"),
    ("ppo.extra.output_dir", "output_dir"), ("ppo.extra.kl_coef", "ppo.kl_coef"),
    ("data.extra.config", "data.subset"), ("data.extra.num_examples", "data.num_examples"),
])
def test_extra_key_shadowing_a_first_class_key_names_that_key(key, first_class):
    with pytest.raises(ConfigError) as err:
        load_config("grpo_math.yaml", [f"{key}=1"])
    assert f"{key} shadows the first-class key {first_class}: set {first_class} instead" in str(err.value)


def test_fewer_examples_than_one_steps_prompts_is_refused():
    # grpo_math: 8 completions per step / 4 per prompt = 2 prompts; TRL's sampler drops a partial batch
    with pytest.raises(ConfigError, match=r"data.num_examples \(1\) is fewer than the 2 prompts"):
        load_config("grpo_math.yaml", ["data.num_examples=1"])
    assert load_config("grpo_math.yaml", ["data.num_examples=2"]).data.num_examples == 2


# Eleven values that used to pass the loader and fail after the heavy imports (or not at all).
BAD_RUNS = [
    ("grpo.per_device_train_batch_size=0", "grpo.per_device_train_batch_size"),
    ("grpo.gradient_accumulation_steps=0", "grpo.gradient_accumulation_steps"),
    ("rollout.kv_block_size=0", "rollout.kv_block_size"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs"),
    ("grpo.top_p=0", "grpo.top_p"),
    ("grpo.learning_rate=nan", "grpo.learning_rate"),
    ("rollout.kv_memory_fraction=5", "rollout.kv_memory_fraction"),
    ("rewards=[acuracy]", "rewards"),
    ("data.num_examples=-3", "data.num_examples"),
    ("grpo.save_steps=0", "grpo.save_steps"),
    ("grpo.extra.output_dir=/tmp/elsewhere", "grpo.extra.output_dir"),
]


def test_cli_exits_2_naming_the_key_without_torch_or_a_traceback():
    # one interpreter for all eleven: each main() must return 2 before torch/transformers/trl are imported
    code = (
        "import contextlib, io, json, sys\nfrom rlspec.train import main\nout = []\n"
        f"for arg, _ in {BAD_RUNS!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(['config=grpo_math.yaml', arg])\n"
        "    out.append([rc, err.getvalue()])\n"
        "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]\n"
        "print(json.dumps({'runs': out, 'heavy': heavy}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["heavy"] == []
    for (arg, key), (rc, err) in zip(BAD_RUNS, result["runs"], strict=True):
        assert rc == 2 and key in err and "Traceback" not in err, (arg, rc, err)


def test_module_cli_refuses_a_bad_value_in_seconds():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rlspec.train", "config=grpo_math.yaml", "grpo.top_p=0"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "grpo.top_p must be in (0, 1], got 0" in proc.stderr
    assert time.monotonic() - start < 30


def test_nan_is_never_a_valid_value():
    # the rows' valid values are real numbers: NaN compares false with everything, so a rule written as
    # `not v < 0` would let it through; every float rule tests finiteness explicitly
    for key, (valid, *_) in CASES.items():
        if isinstance(valid, float):
            with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
                load_config(None, [override(key, math.nan)])
