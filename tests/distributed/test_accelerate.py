"""Real multi-process training on CPU: `accelerate launch` with 2 processes under DeepSpeed ZeRO-2 and ZeRO-3.

Each test starts tests/distributed/run_checked.py (rlspec.train plus in-run checks) as a subprocess on a
tiny random Llama saved to tmp_path, with the repository's own configs/accelerate files, and then reads
what the ranks reported and wrote. Marked `distributed` (deselect with -m "not distributed"); they need
deepspeed (`pip install -e ".[deepspeed]"`, which `make test` installs).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cache_with_the_machines_kernels

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:  # the rendezvous port: another test run on this machine may hold 29500
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama

    model_dir = tmp_path / "tiny"
    tok = build_char_tokenizer()
    build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def _launch(accelerate_config: str, zero_stage: str, model_dir: Path, tmp_path: Path, *overrides: str):
    """Two processes of run_checked.py under configs/accelerate/<accelerate_config>.yaml, two GRPO steps.
    Returns (the completed process, the output dir, {rank: that rank's report})."""
    pytest.importorskip("deepspeed", reason='DeepSpeed is not installed: pip install -e ".[deepspeed]"')
    out, reports = tmp_path / "out", tmp_path / "reports"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RLSPEC_CACHE": str(cache_with_the_machines_kernels(tmp_path / "cache"))}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs" / "accelerate" / f"{accelerate_config}.yaml"), "--num_processes", "2",
           "--main_process_port", str(_free_port()), str(REPO / "tests" / "distributed" / "run_checked.py"),
           str(reports), zero_stage, "config=grpo_math.yaml", f"model={model_dir}", f"output_dir={out}",
           "rewards=[spread]", "grpo.max_steps=2", "grpo.save_steps=1", "grpo.max_completion_length=8",
           "grpo.learning_rate=0.01",  # big enough to move bf16 weights in one step, so the sync check bites
           "data.num_examples=16", "rollout.max_model_len=256", "rollout.max_num_seqs=8", "wandb.mode=disabled",
           "grpo.extra.disable_tqdm=true",
           "rollout.compile=off",  # these runs test ZeRO; a compile would eat the 2 s drafter warm-up budgets
           *overrides]
    # a hung collective fails this test after 300 s rather than holding the whole suite
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"accelerate launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in reports.glob("rank*.json")}
    assert sorted(ranks) == [0, 1], f"reports from ranks {sorted(ranks)}"
    return proc, out, ranks


def _assert_run_finished(proc, out: Path, ranks: dict) -> None:
    """Two steps on both ranks, one summary (rank 0's), a final model and the checkpoints."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoint-2").is_dir()
    assert proc.stdout.count("finished: 2 steps") == 1, "the summary table is printed by rank 0 only"
    for rank, report in ranks.items():
        assert report["rc"] == 0 and report["world_size"] == 2
        # one push before step 2's rollout, and the engine equalled the gathered policy after it
        assert [s["policy_version"] for s in report["syncs_checked"]] == [1], (rank, report)
        assert report["syncs_checked"][0]["moved"] > 0


def test_grpo_under_zero2_with_a_learned_drafter(tiny_model, tmp_path):
    """ZeRO-2: no gathers; rank 0 warms the drafter and caches it, rank 1 loads rank 0's from the cache; only
    rank 0 exports it, at the end and into every checkpoint."""
    proc, out, ranks = _launch("zero2", "2", tiny_model, tmp_path, "drafter.drafter=eagle3",
                               "drafter.warm_start_s=2", "drafter.warm_start_prompts=4",
                               "drafter.online_trainer=thread", "drafter.draft_vocab_size=32")
    _assert_run_finished(proc, out, ranks)
    assert all(s["gathers"] == 0 for r in ranks.values() for s in r["syncs_checked"])
    warm = [ranks[r]["warm_start"] for r in (0, 1)]
    assert warm[0]["cached"] is False and warm[1]["cached"] is True, (warm, proc.stdout[-3000:])
    assert ranks[1]["warm_start"]["path"] == ranks[0]["warm_start"]["path"]
    assert (out / "drafter" / "config.json").is_file()
    assert (out / "checkpoint-2" / "drafter" / "config.json").is_file()
    assert proc.stdout.count("exported the drafter") == 1


def test_grpo_under_zero3_gathers_in_groups(tiny_model, tmp_path):
    """ZeRO-3 (partitioned at load): each sync gathers the policy in the planned groups, fewer than one per
    parameter with a 50 kB bucket on this ~300 kB model, and the engine equals the gathered policy."""
    proc, out, ranks = _launch("zero3", "3", tiny_model, tmp_path, "rollout.sync_bucket_mb=0.05")
    _assert_run_finished(proc, out, ranks)
    for report in ranks.values():
        sync = report["syncs_checked"][0]
        assert sync["gathers"] == sync["planned_groups"] and 1 < sync["gathers"] < sync["params"], sync


_FSDP_PROBE = """
import os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama
from rlspec.trainers.weight_sync import iter_named_weights
tok = build_char_tokenizer()
model = build_tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id)
mesh = init_device_mesh("cpu", (1,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
try:
    iter_named_weights(model)
except NotImplementedError as exc:
    print("REFUSED:", exc)
dist.destroy_process_group()
"""


def test_fsdp_sharded_policy_is_refused_with_advice():
    """A real FSDP2 policy (one gloo process, in a subprocess so this one keeps no process group) is refused
    with an error that names what to use instead."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _FSDP_PROBE.format(port=_free_port())], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REFUSED:" in proc.stdout and "FSDP" in proc.stdout and "zero3.yaml" in proc.stdout
