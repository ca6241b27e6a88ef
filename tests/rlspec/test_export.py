"""rlspec.export: the CLI and export_drafter turn a drafter (in memory or saved) into the EAGLE-3 format."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlspec.export import export_drafter, main
from rlspec.rollout.speculation.drafters.eagle3_io import load_eagle3, save_eagle3
from rlspec.rollout.speculation.drafters.eagle3_model import Eagle3Config, Eagle3Model
from rlspec.rollout.runtime.model.config import ModelConfig
from tests.conftest import make_tiny_hf

# the tiny 2-layer target repeats its only usable layer id; engines need a bigger target
pytestmark = pytest.mark.filterwarnings("ignore:aux_layer_ids .* repeat a layer")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, target HF config, drafter with a 48-token draft vocabulary)."""
    hf = make_tiny_hf("llama")
    target_dir = tmp_path_factory.mktemp("target")
    hf.save_pretrained(str(target_dir))
    torch.manual_seed(0)
    drafter = Eagle3Model(Eagle3Config.for_target(ModelConfig.from_hf(hf.config), draft_vocab_size=48))
    drafter.set_draft_vocab(torch.randperm(96)[:48])
    return str(target_dir), hf.config, drafter


def test_cli_exports_a_saved_drafter(tiny, tmp_path, capsys):
    target_dir, hf_config, drafter = tiny
    src = save_eagle3(drafter, hf_config, str(tmp_path / "saved"), dtype="float32",
                      metadata={"policy_version": 3})
    rc = main(["--drafter", src, "--target", target_dir, "--out", str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "speculative_config" in printed and "EAGLE3" in printed
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 512
    meta = json.loads((tmp_path / "out" / "rlspec_drafter.json").read_text())
    assert meta["policy_version"] == 3 and meta["dtype"] == "bfloat16" and "rlspec_version" in meta
    assert torch.equal(load_eagle3(str(tmp_path / "out")).d2t, drafter.d2t)


def test_cli_runs_as_a_module(tiny, tmp_path):
    target_dir, hf_config, drafter = tiny
    src = save_eagle3(drafter, hf_config, str(tmp_path / "saved"), dtype="float32")
    cmd = [sys.executable, "-W", "ignore", "-m", "rlspec.export", "--drafter", src, "--target", target_dir,
           "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    rc = main(["--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert rc == 2 and "no config.json" in capsys.readouterr().err


def test_export_from_a_model_and_re_export_without_target(tiny, tmp_path):
    _, hf_config, drafter = tiny
    first = export_drafter(drafter, str(tmp_path / "a"), target=hf_config, dtype="float32")
    again = export_drafter(first, str(tmp_path / "b"), dtype="bfloat16")  # rope etc. from a's config.json
    a = json.loads((tmp_path / "a" / "config.json").read_text())
    b = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {k: v for k, v in a.items() if "dtype" not in k} == {k: v for k, v in b.items() if "dtype" not in k}
    loaded = load_eagle3(again)
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight.detach().bfloat16().float())


def test_export_of_a_model_needs_a_target(tiny, tmp_path):
    with pytest.raises(ValueError, match="needs `target`"):
        export_drafter(tiny[2], str(tmp_path / "a"))


def test_import_rlspec_export_does_not_import_torch():
    code = "import sys, rlspec.export; assert 'torch' not in sys.modules, 'rlspec.export pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
