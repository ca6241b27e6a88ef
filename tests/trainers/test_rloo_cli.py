"""trainer: rloo in the run config and the CLI: the rloo: section shares grpo:'s fields, RLOOConfig follows it, a
lossy mode is refused, and `python -m rlspec.train config=rloo_math.yaml` trains through the engine and checkpoints."""
from __future__ import annotations

import dataclasses
import json

import pytest

from rlspec.config import ConfigError, GRPOSection, RLOOSection, load_config
from tests.rlspec.test_train_cli import tiny_run  # noqa: F401 (the fixture)


def test_rloo_section_shares_the_grpo_fields():
    grpo = {f.name: f.default for f in dataclasses.fields(GRPOSection)}
    rloo = {f.name: f.default for f in dataclasses.fields(RLOOSection)}
    assert set(rloo) - set(grpo) == {"normalize_advantages"}
    assert {k: rloo[k] for k in grpo} == grpo  # declared once, same defaults


def test_rloo_args_follow_the_config(tmp_path):
    from rlspec.trainer_args import build_trainer_args

    cfg = load_config("rloo_math.yaml", ["rloo.max_steps=5", "rloo.normalize_advantages=true",
                                         "rloo.extra.reward_clip_range=[-1.0, 1.0]", "wandb.mode=disabled"])
    assert cfg.trainer == "rloo" and cfg.algorithm is cfg.rloo
    args = build_trainer_args(cfg, tmp_path)
    assert type(args).__name__ == "RLOOConfig"
    assert (args.max_steps, args.num_generations, args.normalize_advantages) == (5, 4, True)
    assert tuple(args.reward_clip_range) == (-1.0, 1.0) and args.beta == 0.0


def test_rloo_config_errors_name_the_rloo_section():
    with pytest.raises(ConfigError, match=r"rloo.per_device_train_batch_size \* rloo.gradient_accumulation_steps"):
        load_config("rloo_math.yaml", ["rloo.num_generations=3"])
    with pytest.raises(ConfigError, match="RLOO has no importance-sampling correction"):
        load_config("rloo_math.yaml", ["drafter.drafter=ngram", "drafter.verification=judge",
                                       "drafter.accept_off_policy=true"])
    with pytest.raises(ConfigError, match="needs trainer=grpo"):
        load_config("rloo_math.yaml", ["partial_rollouts.enabled=true"])


def test_rloo_cli_trains_and_checkpoints(tiny_run, tmp_path):  # noqa: F811
    from rlspec.train import main

    out = tmp_path / "out"
    args = ["config=rloo_math.yaml", "dtype=float32",
            *(a.replace("grpo.", "rloo.") for a in tiny_run if not a.startswith("config="))]
    assert main(args + ["rloo.max_steps=1"]) == 0
    assert (out / "checkpoint-1").is_dir() and (out / "final" / "model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["config"]["trainer"] == "rloo"
    steps = [h for h in summary["history"] if "reward" in h]
    assert len(steps) == 1 and steps[0]["rollout/engine"] == 1.0
