"""rlspec.train: config errors fail fast without torch, GRPOConfig is built as configured, and a whole
run on a tiny random model writes checkpoints, the final model, summary.json and an offline W&B run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlspec.config import ConfigError, load_config
from tests.conftest import cache_with_the_machines_kernels

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_bad_key_exits_nonzero_with_suggestion_and_no_torch():
    proc = _python(
        "import sys\n"
        "from rlspec.train import main\n"
        "rc = main(['config=grpo_math.yaml', 'grpo.max_step=1'])\n"
        "assert 'torch' not in sys.modules, 'config errors must come before heavy imports'\n"
        "sys.exit(rc)\n"
    )
    assert proc.returncode == 2, proc.stderr
    assert "Did you mean 'grpo.max_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_module_cli_rejects_unknown_key():
    proc = subprocess.run([sys.executable, "-m", "rlspec.train", "config=grpo_math.yaml", "bogus=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown key 'bogus'" in proc.stderr and "Valid keys at the top level" in proc.stderr


def test_ppo_config_errors_name_the_ppo_section(capsys):
    from rlspec.train import main

    assert main(["config=ppo_math.yaml", "ppo.num_generations=3"]) == 2
    assert "ppo.num_generations (3" in capsys.readouterr().err


def test_ppo_args_follow_the_config(tmp_path):
    pytest.importorskip("trl")
    from rlspec.trainer_args import build_trainer_args

    cfg = load_config("ppo_math.yaml", ["ppo.max_steps=5", "ppo.extra.warmup_steps=2", "ppo.kl_coef=0.1"])
    args = build_trainer_args(cfg, tmp_path)
    assert type(args).__name__ == "PPOConfig" and args.max_steps == 5 and args.warmup_steps == 2
    assert args.kl_coef == 0.1 and args.num_ppo_epochs == 2 and args.output_dir == str(tmp_path)
    assert args.model_init_kwargs == {"dtype": "float32"} and args.bf16 is False  # ppo_math.yaml runs in float32
    with pytest.raises(ConfigError, match="Did you mean 'num_ppo_epochs'"):
        build_trainer_args(load_config("ppo_math.yaml", ["ppo.extra.num_ppo_epoch=2"]), tmp_path)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
        build_trainer_args(load_config("ppo_math.yaml", ["ppo.extra.gradient_accumulation_steps=2"]), tmp_path)


def test_help_lists_keys(capsys):
    from rlspec.train import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "grpo.max_steps" in out and "drafter.drafter" in out and "config=" in out


def test_grpo_args_follow_the_config(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from rlspec.trainer_args import build_trainer_args
    from rlspec.trainers import sampling_dtype

    monkeypatch.setattr(sampling_dtype, "cpu_supports", lambda dtype: True)  # native bf16 (without: the next test)
    cfg = load_config("grpo_math.yaml", ["grpo.max_steps=5", "grpo.extra.warmup_steps=2", "wandb.mode=disabled"])
    args = build_trainer_args(cfg, tmp_path)
    assert args.max_steps == 5 and args.num_generations == 4 and args.warmup_steps == 2
    assert args.output_dir == str(tmp_path) and args.seed == cfg.seed
    assert args.bf16 is True and args.model_init_kwargs == {"dtype": "float32"}  # fp32 master weights
    assert args.report_to in ("none", [], ["none"])
    assert build_trainer_args(load_config("grpo_math.yaml", []), tmp_path).report_to == ["wandb"]


def test_a_cpu_without_native_bf16_trains_and_samples_in_float32(tiny_run, tmp_path, monkeypatch, caplog):
    """dtype bfloat16 where oneDNN would emulate bf16 (a training pass 22x slower than float32,
    bench_out/passes_no_native_bf16_*.json): the run trains without autocast and its engine samples in float32,
    with a warning; where the CPU has native bf16 both stay bf16."""
    import torch

    import rlspec.train as train
    from rlspec.trainers import sampling_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for native in (False, True):
        monkeypatch.setattr(sampling_dtype, "cpu_supports", lambda dtype: native or dtype == torch.float32)
        caplog.clear()
        trainer, _ = train.build_trainer(load_config("grpo_math.yaml", tiny_run[1:]), tmp_path / f"out{native}")
        assert trainer.args.bf16 is native
        engine_dtype = next(trainer.engine.runner.model.parameters()).dtype
        assert engine_dtype == (torch.bfloat16 if native else torch.float32)
        assert ("no native bf16" in caplog.text) is not native


def test_grpo_extra_is_checked_against_grpoconfig(tmp_path):
    pytest.importorskip("trl")
    from rlspec.trainer_args import build_trainer_args

    with pytest.raises(ConfigError, match="Did you mean 'warmup_steps'"):
        build_trainer_args(load_config(None, ["grpo.extra.warmup_step=2"]), tmp_path)
    with pytest.raises(ConfigError, match="set grpo.max_steps instead"):
        build_trainer_args(load_config(None, ["grpo.extra.max_steps=2"]), tmp_path)


@pytest.fixture
def tiny_run(tmp_path, monkeypatch):
    """A tiny random Llama + char tokenizer saved to disk, W&B offline under tmp_path, and the CLI
    arguments of a short run on it (append more overrides to the returned list)."""
    pytest.importorskip("trl")
    pytest.importorskip("rlspec.trainers.grpo")
    pytest.importorskip("rlspec.rollout.engine")
    from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama

    model_dir = tmp_path / "tiny"
    tok = build_char_tokenizer()
    build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    for var in ("WANDB_DIR", "WANDB_PROJECT"):  # main() sets them; monkeypatch restores them afterwards
        monkeypatch.setenv(var, "unset")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return ["config=grpo_math.yaml", f"model={model_dir}", f"output_dir={tmp_path / 'out'}",
            "grpo.save_steps=1", "grpo.max_completion_length=8", "data.num_examples=16",
            "rollout.max_model_len=256", "rollout.max_num_seqs=8", "grpo.extra.disable_tqdm=true",
            "rollout.compile=off"]  # compiled steps are tests/rollout/runtime/test_compiled.py's; here seconds of C++


def test_cli_end_to_end_on_a_tiny_model(tiny_run, tmp_path, capsys):
    """Two GRPO steps through main(): checkpoints, final model, summary.json and the offline W&B run."""
    from rlspec.train import main

    out = tmp_path / "out"
    assert main(tiny_run + ["grpo.max_steps=2"]) == 0
    assert (out / "final" / "config.json").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (out / "checkpoint-2").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2 and len(summary["rows"]) == 2
    assert summary["tokens_per_s"] > 0 and 0 < summary["rollout_share"] <= 1
    assert summary["config"]["grpo"]["max_steps"] == 2
    assert list((out / "wandb").glob("wandb/offline-run-*")), "an offline W&B run directory"
    printed = capsys.readouterr().out
    assert "rollout %" in printed and "finished: 2 steps" in printed


def test_ppo_cli_end_to_end_on_a_tiny_model(tiny_run, tmp_path, capsys):
    """Two PPO steps through main() with speculation on: the same outputs as GRPO (checkpoints with the
    value model, final model, summary.json with PPO's curves, the summary table)."""
    from rlspec.train import main

    out = tmp_path / "out"
    args = [a.replace("grpo.", "ppo.") for a in tiny_run if not a.startswith("config=")]
    assert main(["config=ppo_math.yaml", *args, "ppo.max_steps=2", "ppo.num_ppo_epochs=1",
                 "drafter.drafter=suffix"]) == 0
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "value_model.safetensors").is_file()
    assert (out / "checkpoint-2" / "value_model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2 and len(summary["rows"]) == 2
    assert summary["config"]["trainer"] == "ppo" and summary["tokens_per_s"] > 0
    assert all("loss/value" in h and "reward" in h for h in summary["history"])
    assert list((out / "wandb").glob("wandb/offline-run-*")), "an offline W&B run directory"
    printed = capsys.readouterr().out
    assert "rollout %" in printed and "finished: 2 steps" in printed


def test_crash_keeps_checkpoints_and_saves_the_policy(tiny_run, tmp_path, monkeypatch):
    """A failure in step 4 re-raises, keeps checkpoint-2, saves the policy after step 3 to <output_dir>/crash
    (no checkpoint holds it) and a summary."""
    import rlspec.trainers.rewards as rewards
    from rlspec.train import main

    calls = []

    def failing_on_second_call(completions, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("reward server went away")
        return [0.0] * len(completions)

    monkeypatch.setitem(rewards.REWARD_FUNCS, "accuracy", failing_on_second_call)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="reward server went away"):
        main(tiny_run + ["grpo.max_steps=5", "grpo.save_steps=2"])
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-3").exists()
    assert (out / "crash" / "model.safetensors").is_file()
    assert not (out / "final").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "crashed" and "reward server went away" in summary["error"]
    assert summary["crash_model"] == str(out / "crash")


def test_learned_drafter_is_warm_started_then_loaded_from_the_cache(tiny_run, tmp_path, monkeypatch, capsys):
    """drafter=eagle3: a bounded warm-up before step 1, cached by the target's weights; a second run of
    the same model loads it instead of training; the summary table shows accepted length and version."""
    from rlspec.train import main

    monkeypatch.setenv("RLSPEC_CACHE", str(cache_with_the_machines_kernels(tmp_path / "cache")))
    run = tiny_run + ["grpo.max_steps=1", "drafter.drafter=eagle3", "drafter.warm_start_s=4",
                      "drafter.warm_start_prompts=8", "drafter.online_trainer=thread", "drafter.draft_vocab_size=32",
                      "rollout.compile=off"]  # compiling the batch-1 step (seconds) would eat the 4 s warm-up budget
    assert main(run) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    first = summary["drafter_warm_start"]
    # step 1's rollout metrics are its own: the warm-up's rollouts are not counted in them
    assert summary["history"][0]["rollout/generated_tokens"] <= 8 * 8  # 8 completions x 8 tokens
    assert first["cached"] is False and first["steps"] > 0 and first["tokens"] > 0
    assert (Path(first["path"]) / "config.json").is_file() and str(tmp_path / "cache") in first["path"]
    # every checkpoint carries the drafter as of its step (a crash after it loses neither)
    assert (tmp_path / "out" / "checkpoint-1" / "drafter" / "config.json").is_file()
    printed = capsys.readouterr().out
    assert "accepted" in printed and "drafter v" in printed and "drafter warm start" in printed

    assert main(run + [f"output_dir={tmp_path / 'out2'}"]) == 0
    second = json.loads((tmp_path / "out2" / "summary.json").read_text())["drafter_warm_start"]
    assert second["cached"] is True and second["path"] == first["path"] and second["steps"] == 0
