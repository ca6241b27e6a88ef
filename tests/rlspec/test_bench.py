"""`python -m rlspec.bench`: the listing is fast and complete, every benchmark has a working --help, the harness
alternates, takes medians and one-run ratios and dates its reports, and each benchmark's --smoke run writes its
JSON (in-process, so torch and TRL are imported once)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlspec.bench import harness
from rlspec.bench.__main__ import REGISTRY, MissingBenchmark, bench_parser, load, main

ROOT = Path(__file__).resolve().parents[2]
OWN = [name for name, mod in REGISTRY.items() if (ROOT / (mod.replace(".", "/") + ".py")).is_file()]


def test_listing_names_every_benchmark_without_importing_torch():
    code = ("import sys\nfrom rlspec.bench.__main__ import main\nmain(['--help'])\n"
            "assert 'torch' not in sys.modules, 'the listing must not import torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.split("benchmarks:\n")[1].splitlines() if line.strip()]
    assert listed == list(REGISTRY) and len(listed) >= 8
    assert "(no HELP line)" not in proc.stdout


@pytest.mark.parametrize("name", OWN)
def test_every_benchmark_has_help_and_the_common_flags(name):
    text = bench_parser(load(name)).format_help()
    assert all(flag in text for flag in harness.COMMON_FLAGS), text


def test_unknown_or_missing_benchmark_says_what_to_do(monkeypatch):
    with pytest.raises(MissingBenchmark, match="unknown benchmark 'nope'; choose one of: rollout"):
        load("nope")
    monkeypatch.setitem(REGISTRY, "ghost", "rlspec.bench.ghost")
    with pytest.raises(MissingBenchmark, match=r"module rlspec.bench.ghost is missing \(rlspec/bench/ghost.py\)"):
        load("ghost")


def test_alternate_rotates_arms_and_ratios_pair_each_repetition():
    order = []
    runs = harness.alternate({"a": lambda rep: order.append("a") or 2.0 * (rep + 1),
                              "b": lambda rep: order.append("b") or 1.0 * (rep + 1)}, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]  # who goes first alternates with the repetition
    assert runs == {"a": [2.0, 4.0, 6.0], "b": [1.0, 2.0, 3.0]}
    assert harness.medians(runs) == {"a": 4.0, "b": 2.0}
    # each repetition's ratio uses that repetition's base: drift between repetitions cancels
    assert harness.ratios(runs, "b") == {"a": [2.0, 2.0, 2.0]}


def test_reports_are_dated_and_smoke_runs_never_replace_a_figure(tmp_path):
    import argparse

    meta = harness.provenance("rollout", ["--smoke"])
    assert len(meta["date"]) == 10 and meta["command"] == "python -m rlspec.bench rollout --smoke"
    assert meta["commit"] and "loadavg_1m" in meta["machine"]
    figure = harness.default_out(argparse.Namespace(out=None, smoke=False), "trl-suite")
    assert figure.endswith("bench_out/trl_suite.json")
    assert "outputs/bench_smoke/" in harness.default_out(argparse.Namespace(out=None, smoke=True), "rollout")


def _paged_beats_contiguous(runs: dict) -> bool:
    paged, contiguous = runs["paged@0.001GiB"], runs["contiguous@0.001GiB"]
    return (paged["max_in_flight"] > contiguous["max_in_flight"] and paged["shared_block_refs"] > 0
            and paged["decode_steps"] < contiguous["decode_steps"] and runs["paged@0.0004GiB"]["preemptions"] > 0)


# name -> (extra flags, a check of the report): each smoke run must exercise its benchmark's real pipeline
SMOKE = {
    "rollout": ([], lambda r: {x["backend"] for x in r["rows"]} == {"hf", "engine"} and r["ratio"]["2"] > 0),
    "rollout-longtail": (["--workload", "longtail"], lambda r: [x["config"] for x in r["rows"]]
                         == ["hf", "engine", "suffix"] and r["rows"][2]["speedup_vs_engine"] > 0),
    "step": ([], lambda r: r["rows"][0]["fused_ms"] > 0 and r["verify_steps"][1]["tokens"] == 2
             and r["draft_costs"][0]["drafter"] == "ngram" and r["roofline_ms"] > 0),
    "linear": ([], lambda r: [x["rows"] for x in r["rows"]] == [1, 8] and r["rows"][1]["speedup"] > 0
               and r["steps"][0]["f_linear_step_ms"] > 0 and r["steps"][0]["engine_step_ms"] > 0),
    "drafter": ([], lambda r: [c["round"] for c in r["curve"]] == [0, 1] and r["curve"][1]["train_steps"] == 2
                and len(r["rows"]) == 3),
    "drafter-speed": (["--part", "speed"],
                      lambda r: len(r["rows"]) == 6 and r["memory"]["indexed_bytes_per_token"] > 0),
    "drafter-replay": (["--part", "replay"],
                       lambda r: [x["drafter"] for x in r["rows"]] == ["ngram", "suffix", "ngram_device_own",
                                                                        "ngram_device_siblings", "ngram_device",
                                                                        "suffix_device"]
                       and r["rows"][4]["drafted_share"] == 1.0 and r["rows"][0]["positions"] > 0),
    "grpo": ([], lambda r: [x["drafter"] for x in r["rows"]] == ["none", "suffix"] and r["rows"][1]["wall_s"] > 0),
    "ppo": ([], lambda r: [x["run"] for x in r["rows"]] == ["spec_on", "spec_off"]
            and "rollout_speedup" in r["rows"][0]),
    "kv": ([], lambda r: _paged_beats_contiguous(r["runs"])),
    "ahead": ([], lambda r: [(x["drafter"], x["carry"]) for x in r["rows"]] == [("plain", True), ("plain", False),
                                                                             ("ngram_device", True),
                                                                             ("ngram_device", False),
                                                                             ("eagle3", True)]
              and not any(x["samples_differing"] for x in r["rows"]) and r["rows"][0]["ahead_share"] > 0
              and r["rows"][2]["spec_step_share"] > 0 and r["rows"][4]["spec_step_share"] > 0),
    # samples waiting for rows: two waves of the batch's rows, GRPO groups of two siblings (suffix drafts from them)
    "host-waves": (["--modes", "plain", "suffix", "--waves", "2", "--group", "2"],
                   lambda r: [x["mode"] for x in r["rows"]] == ["plain", "suffix"] and r["args"]["waves"] == 2
                   and r["args"]["group"] == 2 and r["rows"][0]["steps"] > 12 and r["rows"][0]["host_calls"] > 0
                   and r["rows"][1]["spec_share"] > 0),
    "lossy": ([], lambda r: [x["setting"] for x in r["rows"]] == ["target", "lossless", "prob@0.1", "route@-1"]),
    "vllm": ([], lambda r: [x["config"] for x in r["rows"]][:2] == ["engine", "engine-ngram"]
             and r["rows"][0]["tokens_per_s"] > 0),
    "workers": ([], lambda r: [x["config"] for x in r["rows"]] == ["pool 2x1", "engine 1x2"]
                and "N=64" in r["projection"] and [s["step"] for s in r["spot"]["on"]] == [0]),
    "chaos": ([], lambda r: r["ok"] and r["faults"][0]["name"] == "bad_rows" and r["faults"][0]["exit_code"] == 2
              and not r["faults"][0]["reached_step_1"] and r["faults"][0]["handled"]),
    "trl-suite": ([], lambda r: r["summary"]["plain"]["passed"] == r["summary"]["spec"]["passed"] == 1
                  and r["summary"]["spec"]["skipped"] == 1 and "tiny-VisionOnly" in str(r["unbuilt"])),
    "passes": ([], lambda r: [x["pass_"] for x in r["rows"]] == ["trl_padded", "trimmed"]
               and r["rows"][1]["tokens_frac"] < 1.0 and all(x["fwd_bwd_s"] > 0 for x in r["rows"])),
    # one arm of four (the ratios: tests/rlspec/test_bench_partial.py): it trains samples carried from the step before
    "partial": (["--arms", "on/spec"], lambda r: [x["arm"] for x in r["rows"]] == ["on/spec"]
                and r["rows"][0]["carried_samples"] > 0 and r["rows"][0]["staleness_mean"] > 0
                and r["rows"][0]["rollout_s_per_step"] > 0),
}


def test_host_groups_that_do_not_divide_the_batch_are_refused_before_any_run(tmp_path):
    with pytest.raises(SystemExit, match=r"--group 4 must .* divide .* for batch 2, 6"):
        main(["host", "--batch-sizes", "2", "8", "6", "--group", "4", "--modes", "plain", "--out",
              str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("case", sorted(SMOKE))
def test_smoke_run_writes_its_report(case, tmp_path, smollm2_dir):
    flags, check = SMOKE[case]
    out = tmp_path / "report.json"
    main([case.split("-")[0] if case not in REGISTRY else case, "--smoke", "--out", str(out), *flags])
    report = json.loads(out.read_text())
    assert report["benchmark"] in REGISTRY and report["date"] and report["commit"]
    assert check(report), json.dumps({k: v for k, v in report.items() if k in ("rows", "runs", "faults")})[:3000]


def undefined_names(source: str) -> list[str]:
    """Names a module loads that nothing in it binds (import, def, class, assignment, argument) and that are not
    builtins: a file split into modules that lost an import or a constant fails here, not at the end of a run."""
    import ast
    import builtins

    tree = ast.parse(source)
    bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound)


@pytest.mark.parametrize("path", sorted((ROOT / "rlspec" / "bench").rglob("*.py")), ids=lambda p: p.name)
def test_bench_modules_use_no_unbound_name(path):
    assert undefined_names(path.read_text()) == []


def test_unbound_name_check_sees_a_lost_import():
    assert undefined_names("import json\n\ndef f(x):\n    return json.dumps(x) + first_line(x)\n") == ["first_line"]


def test_drafter_replay_counts_what_a_verify_accepts():
    """A sample repeating its prompt's period-3 pattern: prompt lookup drafts it exactly, so every position accepts
    as many tokens as remain, up to k (11 positions of 4, then 3, 2, 1); a sibling's text adds nothing wrong."""
    from rlspec.bench.drafter_replay import replay

    pattern = [5, 6, 7]
    totals = replay([(0, pattern * 2, [pattern * 5, pattern * 5])], k=4)
    for name in ("ngram", "ngram_device_own", "ngram_device_siblings", "ngram_device"):
        assert totals[name][:3] == [2 * 50, 2 * 14, 2 * 14], (name, totals[name])


def test_drafter_replay_looks_up_the_earlier_epochs():
    """A sample of unrepeated tokens: nothing in its own text predicts it, so the device lookup accepts nothing in the
    first epoch; in the second the same completion is in the prompt's history, which predicts every position (4 a
    position, then 3, 2, 1), while the lookup without history still accepts nothing."""
    from rlspec.bench.drafter_replay import replay
    from rlspec.rollout.speculation.drafters.prompt_history import PromptHistory

    history = PromptHistory()
    group = [(0, [1, 2, 3], [list(range(10, 30))])]
    first = replay(group, k=4, history=history)
    assert first["ngram_device"][0] == first["ngram_device_siblings"][0] == 0 and history.count([1, 2, 3]) == 1
    second = replay(group, k=4, history=history)
    assert second["ngram_device"][:2] == [4 * 16 + 3 + 2 + 1, 19] and second["ngram_device_siblings"][0] == 0
