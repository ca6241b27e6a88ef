"""rlspec.config: strict YAML loading, dotted overrides, and error messages that say how to fix things."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlspec.config import Config, ConfigError, format_help, load_config, resolve_config_path

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_without_a_file():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.trainer == "grpo" and cfg.rewards == ["accuracy"] and cfg.drafter.drafter == "none"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads(path):
    cfg = load_config(str(path), [])
    assert isinstance(cfg, Config)
    assert cfg.to_dict()["grpo"]["num_generations"] == cfg.grpo.num_generations


def test_shipped_configs_exist():
    names = {p.name for p in SHIPPED}
    assert {"grpo_math.yaml", "grpo_gsm8k_qwen.yaml"} <= names


def test_grpo_extra_keys_are_grpoconfig_fields():
    trl = pytest.importorskip("trl")
    valid = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    if "gradient_checkpointing" in valid:  # transformers < 5.24's name for it, which trainer_args maps it to
        valid.add("activation_checkpointing")
    for path in SHIPPED:
        cfg = load_config(str(path), [])
        assert set(cfg.grpo.extra) <= valid, path.name
        named = {f.name for f in dataclasses.fields(cfg.grpo)} - {"extra"}
        assert named <= valid, "every named grpo key must map onto a GRPOConfig field"


def test_config_found_by_name_and_without_suffix():
    assert resolve_config_path("grpo_math.yaml") == REPO / "configs" / "grpo_math.yaml"
    assert load_config("grpo_math", []).model == "smollm2-135m-instruct"


def test_missing_config_file_says_where_it_looked(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config("no_such_recipe.yaml", [])
    msg = str(err.value)
    assert "no_such_recipe.yaml" in msg and "Looked in" in msg
    assert str(REPO / "configs" / "no_such_recipe.yaml") in msg


def test_unknown_top_level_key_names_nearest(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "grop:\n  max_steps: 3\n"), [])
    msg = str(err.value)
    assert "'grop'" in msg and "Did you mean 'grpo'" in msg and "run.yaml" in msg


def test_unknown_nested_key_names_nearest_and_section(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "grpo:\n  max_step: 3\n"), [])
    msg = str(err.value)
    assert "section 'grpo'" in msg and "Did you mean 'grpo.max_steps'" in msg


def test_wrong_type_names_field_type_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "grpo:\n  max_steps: lots\n"), [])
    msg = str(err.value)
    assert "grpo.max_steps" in msg and "int" in msg and "'lots'" in msg


def test_bool_is_not_an_int(tmp_path):
    with pytest.raises(ConfigError, match="seed expects int"):
        load_config(_write(tmp_path, "seed: true\n"), [])


def test_bad_enum_lists_valid_values(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, "drafter:\n  drafter: medusa\n"), [])
    msg = str(err.value)
    assert "drafter.drafter" in msg and "'medusa'" in msg
    for valid in ("none", "ngram", "suffix", "eagle3", "auto"):
        assert valid in msg


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="grpo must be a mapping"):
        load_config(_write(tmp_path, "grpo: 3\n"), [])


def test_yaml_exponent_without_dot_reads_as_float(tmp_path):
    # YAML 1.1 reads 1e-6 as a string; a learning rate written that way must still work.
    cfg = load_config(_write(tmp_path, "grpo:\n  learning_rate: 1e-6\n"), [])
    assert cfg.grpo.learning_rate == pytest.approx(1e-6)


def test_overrides_nested_and_coerced():
    cfg = load_config("grpo_math.yaml", [
        "grpo.max_steps=3", "drafter.drafter=suffix", "grpo.learning_rate=2e-6", "wandb.run_name=123",
        "grpo.temperature=1", "rewards=[accuracy,format]", "grpo.extra.warmup_steps=2", "drafter.drafter_path=null",
    ])
    assert cfg.grpo.max_steps == 3 and cfg.drafter.drafter == "suffix"
    assert cfg.grpo.learning_rate == pytest.approx(2e-6)
    assert cfg.wandb.run_name == "123"  # string fields keep the text verbatim
    assert isinstance(cfg.grpo.temperature, float) and cfg.grpo.temperature == 1.0
    assert cfg.rewards == ["accuracy", "format"]
    assert cfg.grpo.extra == {"vllm_importance_sampling_mode": "token_truncate", "warmup_steps": 2}  # merged
    assert cfg.drafter.drafter_path is None
    assert cfg.grpo.num_generations == 4  # untouched keys keep the file's values


def test_single_reward_override_becomes_a_list():
    assert load_config(None, ["rewards=format"]).rewards == ["format"]


def test_unknown_override_key_names_nearest():
    with pytest.raises(ConfigError) as err:
        load_config("grpo_math.yaml", ["grpo.max_step=3"])
    msg = str(err.value)
    assert "override 'grpo.max_step=3'" in msg and "Did you mean 'grpo.max_steps'" in msg


def test_override_type_error_names_the_override():
    with pytest.raises(ConfigError) as err:
        load_config("grpo_math.yaml", ["grpo.max_steps=abc"])
    msg = str(err.value)
    assert "override 'grpo.max_steps=abc'" in msg and "expects int" in msg


def test_override_bad_enum_and_malformed():
    with pytest.raises(ConfigError, match="one of"):
        load_config(None, ["dtype=float16"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["grpo.max_steps"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["seed.value=1"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, ["grpo=3"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="multiple of grpo.num_generations"):
        load_config(None, ["grpo.num_generations=3", "grpo.per_device_train_batch_size=8"])
    with pytest.raises(ConfigError, match="max_model_len"):
        load_config(None, ["rollout.max_model_len=64", "grpo.max_completion_length=64"])
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        load_config(None, ["grpo.num_generations=1"])


def test_every_field_has_help():
    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help string"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)
                                                   and dataclasses.is_dataclass(f.default_factory)):
                walk(f.default_factory)

    walk(Config)
    text = format_help()
    assert "grpo.max_steps" in text and "drafter.drafter" in text


def test_to_dict_round_trips(tmp_path):
    import yaml

    cfg = load_config("grpo_math.yaml", ["drafter.drafter=ngram", "grpo.extra.warmup_steps=2"])
    d = cfg.to_dict()
    assert d["drafter"]["drafter"] == "ngram" and d["data"]["name"] == "embedded_math"
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(d))
    assert load_config(str(path), []) == cfg


def test_rollout_graph_mode_offers_exactly_the_graph_pools_modes():
    from typing import get_args, get_type_hints

    from rlspec.config import RolloutSection
    from rlspec.rollout.runtime.graphs import MODES

    assert get_args(get_type_hints(RolloutSection)["graph_mode"]) == MODES
    assert load_config(None, ["rollout.graph_mode=eager_start"]).rollout.graph_mode == "eager_start"
    with pytest.raises(ConfigError, match="rollout.graph_mode must be one of"):
        load_config(None, ["rollout.graph_mode=always"])


def test_rollout_kv_budget_fields_load_and_name_the_engine_arguments():
    import inspect

    from rlspec.rollout.engine import RolloutEngine

    cfg = load_config(None, ["rollout.kv_memory_gb=40", "rollout.free_kv_between_rollouts=false"]).rollout
    assert cfg.kv_memory_gb == 40.0 and cfg.free_kv_between_rollouts is False and cfg.kv_memory_fraction is None
    engine_args = inspect.signature(RolloutEngine).parameters
    for name in ("kv_memory_gb", "kv_memory_fraction", "kv_block_size", "free_kv_between_rollouts"):
        assert name in engine_args, f"rollout.{name} reaches RolloutEngine under the same name"


def test_workers_imply_the_ray_backend_and_bad_ray_settings_say_what_to_fix():
    cfg = load_config(None, ["rollout.workers=4", "rollout.ray_address=auto"])
    assert cfg.rollout.backend == "ray"
    assert cfg.rollout.pool_kwargs()["workers"] == 4 and cfg.rollout.pool_kwargs()["ray_address"] == "auto"
    assert load_config(None, ["rollout.workers=1"]).rollout.backend == "engine"
    assert load_config(None, []).rollout.pool_kwargs() == {}
    with pytest.raises(ConfigError, match="rollout.workers must be >= 1"):
        load_config(None, ["rollout.workers=0"])
    with pytest.raises(ConfigError, match="groups_per_task must be >= 1"):
        load_config(None, ["rollout.groups_per_task=0"])


@pytest.mark.parametrize("other", [["trainer=ppo"], ["rollout.backend=ray"], ["rollout.backend=vllm"]])
def test_partial_rollouts_need_grpo_on_the_in_process_engine(other):
    """Only the engine stops a round and carries samples (docs/partial_rollouts.md#limits): refused before step 1."""
    with pytest.raises(ConfigError, match="partial_rollouts.enabled needs trainer=grpo and rollout.backend=engine"):
        load_config(None, ["partial_rollouts.enabled=true", *other])
    assert load_config(None, ["partial_rollouts.enabled=true"]).partial_rollouts.enabled
