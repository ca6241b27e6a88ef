"""scripts/bench_gpu.py (the benchmark half of `make gpu-check`) keeps working without a GPU: --help,
and --smoke, which runs the whole pipeline on a tiny model (on CPU here) and writes its JSON."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/bench_gpu.py"


def test_help_lists_the_options():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--budget-s" in out.stdout and "--smoke" in out.stdout


def test_smoke_run_measures_every_column(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(out.read_text())
    # the eager-layer graphs at both batches, then the compiled-layer arm at the smoke's one compile batch
    assert [(r["compile"], r["batch"]) for r in payload["results"]] == [("off", 1), ("off", 2), ("on", 1)]
    assert not payload["skipped"]
    keys = {"hf_tok_s", "engine_tok_s", "step_eager_ms", "step_graph_ms", "achieved_gbs", "bw_fraction"}
    assert all(keys <= r.keys() and all(r[k] > 0 for k in keys) for r in payload["results"])
    assert payload["peak_gbs"] > 0 and payload["models"]["tiny"]["kv_cache_mib"] > 0
    # the pool sweep: two passes over two lengths, each call's pool sized for it
    sweep = payload["pool_sweep"]
    assert [(c["rep"], c["new_tokens"]) for c in sweep] == [(0, 4), (0, 8), (1, 4), (1, 8)]
    assert all(c["seconds"] > 0 and c["pool_blocks"] > 0 for c in sweep)
    assert "x graph" in proc.stdout  # the summary table
