"""The device check (rlspec/bench/gpu.py, `make gpu-check`) never rots on a machine without a GPU: its CPU
rehearsal writes every section of the report; the test runner times out a hung test, records a crashed one
without losing the tests after them, lists the ones time ran out for and runs the compiled layers' last; a timed
call that captured is flagged; the section limits fit the budget, and a section that ends early leaves its seconds
to the ones after; the oracle drafters' acceptance is what they say; the tree it verifies is a tree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlspec.bench import gpu
from rlspec.bench.gpucheck import cuda_tests, presets
from rlspec.bench.gpucheck.oracle import OracleDrafter, expected_tokens
from rlspec.bench.gpucheck.predict import annotate, from_plain
from rlspec.bench.gpucheck.spec_costs import tree

ROOT = Path(__file__).resolve().parents[1]


def _installed(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def test_rehearsal_writes_every_section(tmp_path):
    """`make gpu-rehearsal`: the whole check at tiny shapes on the CPU, each section complete, in minutes."""
    proc = subprocess.run([sys.executable, "-m", "rlspec.bench.gpu", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    report = json.loads((tmp_path / "report.json").read_text())
    logs = {s: (tmp_path / f"{s}.log").read_text()[-2000:] for s in gpu.SECTIONS
            if (tmp_path / f"{s}.log").exists()}
    assert proc.returncode == 0, (proc.stdout[-3000:], logs)
    assert all(report[s]["status"] in ("ok", "skipped") for s in gpu.SECTIONS), logs
    assert report["commit"] and report["dirty"] in (True, False)  # written from the tree it ran
    assert report["triton"] == _installed("triton")  # our kernels' compiler, beside torch's version
    # each measuring section says what Triton compiled in it (counted through Triton's hooks where it has them; its
    # interpreter, here, compiles nothing), and each timed call how many compiles it held
    for s in ("plain", "spec_costs", "profile", "contexts", "oracle", "e2e"):
        if report[s]["status"] != "skipped":
            assert report[s]["triton_compiles"] == dict(counted=bool(report["triton"]), count=0, built=0,
                                                        seconds=0.0, kernels={}), s
    assert report["aims"] == {"skipped": "the aims are set for an H200; this report is from cpu"}
    # the compile-ahead child ran beside the tests over the measuring sections that compile, and was stopped with
    # them (or had finished); its log is kept
    early = report["ahead"]
    assert early["sections"] == ["plain", "spec_costs", "contexts", "oracle"], early
    assert early["status"] in ("stopped", "finished") and (tmp_path / early["log"]).is_file(), early
    assert early["triton_compiles"] == dict(count=0, built=0, seconds=0)
    # the CUDA tests ran (and skipped themselves on a CPU): one row per test in report.json, core and rest apart
    core, rest = report["tests"]["tests"], report["tests_rest"]["tests"]
    assert core and rest and all({"test", "outcome", "seconds"} <= r.keys() for r in core + rest)
    assert not {r["test"] for r in core} & {r["test"] for r in rest}
    assert any("test_cuda_paging" in r["test"] for r in core) and any("device_order" in r["test"] for r in rest)
    # plain: every key captured before timing, three timed calls a row, their steps and captures recorded
    plain = report["plain"]["rows"]
    assert {(r["model"], r["batch"]) for r in plain} == {("tiny", 1), ("tiny", 2)}
    assert all(r["engine_tok_s"] > 0 and r["step_graph_ms"] > 0 and len(r["step_graph_ms_all"]) == 3 for r in plain)
    assert all(r["timed_captures"] == r["timed_compiles"] == 0 and len(r["decode_steps"]) == 3 and
               min(r["decode_steps"]) > 0 for r in plain)
    assert all(r["bytes_moved"] > 0 and r["limit_ms"] is None for r in plain)  # no bandwidth figure for a CPU
    verify = report["spec_costs"]["verify"]
    assert {(r["kind"], r["tokens"]) for r in verify} == {("chain", 1), ("chain", 2), ("chain", 5), ("tree", 4)}
    draft = report["spec_costs"]["eagle3_draft"]
    assert [r["batch"] for r in draft] == [1, 2] and all(r["draft_level_ms"] > 0 for r in draft)
    assert draft[-1]["level_graphs"]["captures"] > 0  # the drafter's levels went through the graph bookkeeping
    assert all(r["timed_captures"] == r["timed_compiles"] == 0 for r in draft)
    prof = report["profile"]["rows"]
    assert [(p["batch"], p["arm"]) for p in prof] == [(1, "plain"), (2, "plain"), (2, "oracle a=0.7 k=4")]
    assert all(p["decode_steps"] > 0 and p["top_host_ops"] for p in prof)
    assert prof[-1]["accept_len"] > 1.5  # the speculative rollout profiled drafted, and the target took its drafts
    # the default pass, FlexAttention's compare row and the row without PDL (on a CPU none of them took it)
    assert [(r["context"], r["batch"]) for r in report["contexts"]["rows"]] == \
        [(c, b) for c in (16, 64) for b in (1, 2)] + [(64, 2), (16, 1)]
    assert not any(r["pdl"] for r in report["contexts"]["rows"]) and report["plain"]["pdl"] == {}
    # the paged kernel alone (Triton's interpreter here): its default launch, then the others listed
    launches = [(r["keys"], r["stages"], r["per_sm"], r["default"]) for r in report["contexts"]["attention"]]
    assert launches == [(64, 3, 2, True), (16, 3, 2, False)], launches
    assert all(r["us"] > 0 and r["kv_tb_s"] > 0 and r["splits"] >= 1 for r in report["contexts"]["attention"])
    rows = report["oracle"]["rows"]
    assert {(r["batch"], r["accept"]) for r in rows} == {(b, a) for b in (1, 2) for a in (0.5, 0.7, 0.9)}
    assert [r["accept"] for r in rows if r["batch"] == 1] == [0.5, 0.7, 0.9]
    assert [r["accept"] for r in rows if r["batch"] == 2] == [0.7, 0.9, 0.5]  # rotated: not always low to high
    # the fixed chains: the warm-up met every graph key, and each length's repetitions ran the same steps
    assert all(r["timed_captures"] == r["timed_compiles"] == 0 and len(r["seconds_all_24"]) == 3 for r in rows)
    assert all(len(set(r[f"decode_steps_{n}"])) == 1 for r in rows for n in (8, 24))
    assert all(r["decode_speedup"] > 0 and r["step_ms"] > 0 and r["accept_len"] >= 1 for r in rows)
    # greedy speculation is exact: the oracle's rollouts are the plain ones, token for token (float32 on CPU)
    assert all(r["same_as_reference"] == 1.0 for r in rows)
    assert all(r["predicted_speedup"] > 0 and r["vs_predicted"] > 0 for r in rows)  # this run's 5-token verifies
    e2e = report["e2e"]
    if e2e["status"] != "skipped":
        arms = {r["arm"]: r for r in e2e["rows"]}
        assert set(arms) == {"trl", "spec", "spec-oracle"} and all(r["step_s"] > 0 for r in arms.values())
        assert all(r["phases_s_per_step"]["rollout"] > 0 for r in arms.values())
        assert arms["spec-oracle"]["accept_len"] > 1.5  # the oracle's drafts are the model's own continuation
        # which TRL and datasets the arms ran, and where from (the carried site when there is one)
        carried = (ROOT / ".cache" / "gpu_carry" / "site").resolve()
        for name in ("trl", "datasets"):
            ran = e2e["packages"][name]
            assert ran["version"] and (Path(ran["from"]) == carried) == carried.is_dir(), ran


def test_hung_and_crashed_tests_are_recorded_and_the_rest_still_run(tmp_path):
    """A test past its own timeout is killed and recorded as "timeout", one that kills its process as "crashed";
    pytest starts again after each and the tests after them run."""
    (tmp_path / "test_faults.py").write_text(
        "import os, time\n"
        "def test_a_passes():\n    pass\n"
        "def test_b_hangs():\n    time.sleep(600)\n"
        "def test_c_crashes():\n    os._exit(3)\n"
        "def test_d_fails():\n    assert False\n"
        "def test_e_passes():\n    pass\n")
    out = tmp_path / "out"
    out.mkdir()
    section = cuda_tests.run([str(tmp_path / "test_faults.py")], None, per_test_s=3.0, total_s=120, out=out,
                             root=tmp_path)
    outcome = {r["test"].split("::")[1]: r["outcome"] for r in section["tests"]}
    assert outcome == {"test_a_passes": "passed", "test_b_hangs": "timeout", "test_c_crashes": "crashed",
                       "test_d_fails": "failed", "test_e_passes": "passed"}
    assert section["passes"] == 3 and not section["ok"]
    assert next(r for r in section["tests"] if "hangs" in r["test"])["seconds"] < 30


class _Seq:
    def __init__(self, prompt, completion):
        self.prompt_ids, self.completion_ids = prompt, completion


@pytest.mark.parametrize("a", [0.5, 0.9])
def test_oracle_drafter_keeps_each_token_with_probability_a(a):
    """Each drafted token is the reference's with probability a, and otherwise never is; a position drafts the
    same token whenever it is drafted, and a higher a keeps every position a lower one kept."""
    ref = list(range(10, 10 + 4000))
    d = OracleDrafter({(1, 2): ref}, vocab=5000, accept=a, seed=0)
    kept = total = 0
    for n in range(1, 3990, 4):  # completion_ids[-1] is the pending token: drafts start at ref[n]
        draft = d.propose([_Seq([1, 2], ref[:n])], [4], 1)[0]
        assert draft.is_chain and len(draft) == 4
        kept += sum(t == r for t, r in zip(draft.tokens, ref[n:n + 4]))
        total += 4
        assert d.propose([_Seq([1, 2], ref[:n + 2])], [2], 1)[0].tokens == draft.tokens[2:]
    assert abs(kept / total - a) < 0.03
    lower = OracleDrafter({(1, 2): ref}, vocab=5000, accept=a - 0.3, seed=0).chains[(1, 2)]
    assert all(t == r for t, low, r in zip(d.chains[(1, 2)], lower, ref) if low == r)
    assert expected_tokens(a, 4) == pytest.approx(sum(a ** i for i in range(5)))
    assert d.propose([_Seq([7], [3])], [4], 1)[0].tokens == []  # an unknown prompt: no draft


@pytest.mark.parametrize("look_ahead", [False, True])
def test_oracle_drafts_on_the_device_and_its_chains_are_looked_ahead(look_ahead, monkeypatch):
    """In an engine the oracle drafts on the device: its chains are its host proposals (the reference's, replaced
    where a position's uniform is over a), greedy rollouts stay the plain ones, a verify accepts about E_k tokens,
    and with the look-ahead on (as on CUDA) most chain steps are launched before the host reads the step in front."""
    import torch

    from rlspec.bench.gpucheck.common import build_hf, engine_over, make_greedy_stable
    from rlspec.rollout.chains_ahead import AheadChains
    from rlspec.rollout.types import SamplingParams, SpecConfig

    hf = build_hf("tiny", torch.float32, torch.device("cpu"))
    make_greedy_stable(hf)
    prompts = [list(range(5 + i, 21 + i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    plain = engine_over(hf, torch.device("cpu"), torch.float32, 4, 96)
    ref = {tuple(r.prompt_ids): r.completion_ids for r in plain.generate(prompts, params)}
    drafter = OracleDrafter(ref, hf.config.vocab_size, 0.7)
    spec = SpecConfig(drafter="ngram", selector="always", num_draft_tokens=4, online_training=False)
    engine = engine_over(hf, torch.device("cpu"), torch.float32, 4, 96, spec=spec, drafter=drafter)
    engine.look_ahead = look_ahead
    seen, real = [], AheadChains._chain_ahead
    monkeypatch.setattr(AheadChains, "_chain_ahead", lambda self, *a: seen.append(real(self, *a)) or seen[-1])
    proposed, tensors = [], OracleDrafter.propose_tensors

    def compared(self, seqs, caps, width):
        out = tensors(self, seqs, caps, width)
        assert [d.tokens for d in out.to_drafts()] == [d.tokens for d in self.propose(seqs, caps, width)]
        proposed.append(len(seqs))
        return out

    monkeypatch.setattr(OracleDrafter, "propose_tensors", compared)
    assert [r.completion_ids for r in engine.generate(prompts, params)] == [ref[tuple(p)] for p in prompts]
    assert proposed and abs(engine.stats()["rollout/accept_len"] - expected_tokens(0.7, 4)) < 0.6
    ahead = [s is not None for s in seen]
    assert (sum(ahead) > len(ahead) // 2) if look_ahead else not seen


def test_tree_mask_sees_ancestors_only():
    depths, mask = tree(7)  # heap order: 0 -> (1, 2), 1 -> (3, 4), 2 -> (5, 6)
    assert depths.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert mask[6].nonzero().flatten().tolist() == [0, 2, 6]
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 3]
    assert mask.sum().item() == 7 + 6 + 4  # self, parent, grandparent


def test_help_and_contract():
    import argparse

    p = argparse.ArgumentParser()
    gpu.add_arguments(p)
    args = p.parse_args(["--smoke", "--out", "x", "--timeout-s", "tests=150", "oracle=200"])
    assert gpu.NAME == "gpu" and gpu.HELP and args.smoke and args.out == "x" and callable(gpu.run)
    limits = presets.timeouts(False, args.timeout_s)  # the documented form, SECTION=SECONDS
    assert limits["tests"] == 150 and limits["oracle"] == 200 and limits["plain"] == presets.GPU_LIMITS["plain"]
    with pytest.raises(SystemExit, match="SECTION=SECONDS"):
        presets.timeouts(False, ["150"])
    out = subprocess.run([sys.executable, "-m", "rlspec.bench.gpu", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and "--smoke" in out.stdout and "--sections" in out.stdout


def test_the_formula_reads_verify_costs_off_plain_steps_and_annotates_oracle_rows():
    steps = {1: 8.0, 8: 8.5, 32: 10.0, 128: 16.0}  # ms by batch, the shape of the 7B graph steps
    assert from_plain(steps, 1, 8) == pytest.approx(8.5 / 8.0)  # 8 rows of one token: batch 8's step
    assert from_plain(steps, 8, 4) == pytest.approx(10.0 / 8.5)
    assert from_plain(steps, 32, 8) == pytest.approx((16.0 + 6.0 / 96 * 128) / 10.0)  # past the largest: linear
    report = {"spec_costs": {"verify": [{"batch": 8, "kind": "chain", "tokens": 5, "vs_plain": 1.25},
                                        {"batch": 8, "kind": "tree", "tokens": 5, "vs_plain": 9.0}]},
              "oracle": {"num_draft_tokens": 4, "rows": [{"batch": 8, "accept": 0.5, "accept_len": 2.0,
                                                          "decode_speedup": 1.5}, {"batch": 32, "accept": 0.5}]}}
    annotate(report)
    rows = report["oracle"]["rows"]
    assert rows[0]["predicted_speedup"] == pytest.approx(1.9375 / 1.25) and "predicted_speedup" not in rows[1]
    assert rows[0]["predicted_at_measured"] == pytest.approx(2.0 / 1.25)
    assert rows[0]["vs_predicted"] == pytest.approx(1.5 / (1.9375 / 1.25))
    assert rows[0]["vs_predicted_at_measured"] == pytest.approx(1.5 / 1.6)


def test_the_oracle_model_picks_its_greedy_token_by_a_margin_rounding_cannot_flip():
    """bf16 on a GPU: a verify and a decode step round differently, and a plain random model's top two logits lie
    within that rounding, so the oracle's recorded continuation stopped matching (the first H200 run accepted
    nothing). make_greedy_stable: the next token is a fixed permutation of the current one by a wide margin."""
    import torch

    from rlspec.bench.gpucheck.common import build_hf, make_greedy_stable

    hf = build_hf("tiny", torch.bfloat16, torch.device("cpu"))
    ids = torch.randint(3, hf.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        top2 = hf(ids).logits.float().topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() < 0.5  # the plain random model: near ties
        successor = make_greedy_stable(hf)
        logits = hf(ids).logits.float()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]).min().item()
    ulp = top2[..., 0].abs().max().item() * 2 ** -7  # bf16's spacing at the top logit
    assert margin > 20 * ulp, (margin, ulp)
    # a function of the current token alone: the same token maps to the same successor wherever it stands
    nxt = logits.argmax(-1)
    assert torch.equal(nxt, successor[ids])  # the table it returns
    pairs = {}
    for cur, succ in zip(ids.flatten().tolist(), nxt.flatten().tolist()):
        assert pairs.setdefault(cur, succ) == succ
    assert len(set(pairs.values())) == len(pairs)  # a permutation: distinct tokens, distinct successors


def test_the_compiled_extra_times_both_layer_modes_in_process(tmp_path):
    """`--sections compiled` (an extra, outside the check's budget): eager and compiled layers, each row timed both
    ways with its first compiled step and the logits' largest difference (the tiny shape: float32 on the CPU)."""
    proc = subprocess.run([sys.executable, "-m", "rlspec.bench.gpu", "--smoke", "--sections", "compiled", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "report.json").read_text())
    assert proc.returncode == 0 and report["compiled"]["status"] == "ok", proc.stdout[-3000:]
    rows = report["compiled"]["rows"]
    assert [r["batch"] for r in rows] == presets.SMOKE["compiled"]["batches"]
    assert all(r["step_ms_on"] > 0 and r["step_ms_off"] > 0 and r["first_step_s_on"] > 0 for r in rows)
    assert all(r["max_logit_diff"] < 1e-3 for r in rows)  # the same model both ways
    assert "compiled" not in gpu.SECTIONS  # never part of the check's 600 s


def test_section_limits_fit_the_budget():
    """The core (CUDA smoke subset, plain, spec_costs) within 5 minutes, everything within 10."""
    limits = presets.GPU_LIMITS
    assert set(limits) == set(gpu.SECTIONS) and presets.CORE == gpu.SECTIONS[:3]
    assert sum(limits[s] for s in presets.CORE) <= 300 and sum(limits.values()) <= 600
    assert presets.hbm_bytes_s("NVIDIA H200") == 4.8e12 and presets.hbm_bytes_s("cpu") is None


def test_a_section_that_ends_early_leaves_its_seconds_to_the_ones_after(tmp_path, monkeypatch):
    """Each section may take its limit plus what the ones before it left unused (the H200 run of 2026-11-30 left
    ~115 s unused in its measuring sections while tests_rest ran out); the core still ends within 300 s and the
    check within 600 s, whatever each section takes."""
    import types

    clock = [0.0]
    takes = dict(tests=90, plain=65, spec_costs=300, profile=10, contexts=20, oracle=65, e2e=100, tests_rest=999)
    given = {}

    def spend(name, limit):
        given[name] = limit
        clock[0] += min(takes[name], limit)  # a section past its limit is cut off there
        return {"status": "ok" if takes[name] <= limit else "timeout", "tests": []}

    monkeypatch.setattr(gpu, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(gpu, "header", lambda args: {})
    monkeypatch.setattr(gpu, "test_section", lambda name, args, limit, folder: spend(name, limit))
    monkeypatch.setattr(gpu, "child_sections", lambda names, args, folder, limit: {names[0]: spend(names[0], limit)})
    monkeypatch.setattr(gpu.predict, "annotate", lambda report: None)
    monkeypatch.setattr(presets, "print_summary", lambda report: None)
    events = []  # the compile-ahead child: started before the tests, stopped when they end

    class Ahead:
        def stop(self):
            events.append(("stop", sorted(given)))
            return {"status": "stopped"}

    monkeypatch.setattr(gpu.ahead, "start", lambda args, folder, child: events.append("start") or Ahead())
    parser = __import__("argparse").ArgumentParser()
    gpu.add_arguments(parser)
    report = gpu.run(parser.parse_args(["--out", str(tmp_path)]))
    assert events == ["start", ("stop", ["tests"])] and report["ahead"] == {"status": "stopped"}
    limits = presets.GPU_LIMITS
    assert given["tests"] == limits["tests"] and given["plain"] == limits["plain"] + limits["tests"] - 90
    assert given["spec_costs"] == 300 - 90 - 65 and report["spec_costs"]["status"] == "timeout"  # the core: 300 s
    assert given["profile"] == limits["profile"]  # spec_costs used all it had: nothing left over
    assert given["tests_rest"] == 600 - (300 + 10 + 20 + 65 + 100) and clock[0] == 600
    assert report["given_s"]["tests_rest"] == given["tests_rest"]
    events.clear()
    given.clear()
    clock[0] = 0.0
    report = gpu.run(parser.parse_args(["--out", str(tmp_path), "--no-ahead"]))  # the tests alone
    assert events == [] and "ahead" not in report and len(given) == len(presets.SECTIONS)


def test_the_tests_named_last_run_after_the_others(tmp_path):
    """tests_rest runs the compiled layers' tests last (presets.LAST_TESTS, each an Inductor compile): the others
    come first, in their own order, and every name in LAST_TESTS is a test of the check's targets."""
    (tmp_path / "test_order.py").write_text("".join(f"def test_{c}():\n    pass\n" for c in "abcd"))
    out = tmp_path / "out"
    out.mkdir()
    section = cuda_tests.run([str(tmp_path / "test_order.py")], None, per_test_s=30, total_s=60, out=out,
                             root=tmp_path, name="tests_rest", last=["test_order.py::test_b"])
    assert [r["test"].split("::")[1] for r in section["tests"]] == ["test_a", "test_c", "test_d", "test_b"]
    assert section["ok"]
    for prefix in presets.LAST_TESTS:
        path, _, test = prefix.partition("::")
        assert f"def {test}(" in (ROOT / path).read_text(), prefix


def test_tests_time_ran_out_for_are_recorded_as_not_run(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n" + "".join(f"def test_{i}():\n    time.sleep(2)\n" for i in range(6)))
    out = tmp_path / "out"
    out.mkdir()
    section = cuda_tests.run([str(tmp_path / "test_slow.py")], None, per_test_s=30, total_s=5, out=out,
                             root=tmp_path, name="tests_rest")
    outcome = [r["outcome"] for r in section["tests"]]
    assert len(outcome) == 6 and "not_run" in outcome and not section["ok"]
    assert (out / "tests_rest.log").is_file()


class _Counting:
    """An engine's face for timed_calls: a step pool counting captures, stats with decode steps."""

    def __init__(self):
        self.runner = type("R", (), {})()
        self.runner.steps = type("S", (), {"counts": {"captures": 0}})()
        self.speculation = None
        self.steps = 0

    def stats(self):
        out, self.steps = {"rollout/decode_steps": float(self.steps)}, 0
        return out

    def generate(self, capture: bool):
        self.steps += 7
        self.runner.steps.counts["captures"] += capture
        return "done"


def test_a_timed_call_that_captured_is_flagged():
    import torch

    from rlspec.bench.gpucheck.common import timed_calls

    eng = _Counting()
    calls = iter([True, False, False])
    got = timed_calls(eng, lambda: eng.generate(next(calls)), torch.device("cpu"), 3)
    assert got["captures"] == [1, 0, 0] and got["timed_captures"] == 1 and got["decode_steps"] == [7, 7, 7]
    assert got["value"] == "done" and len(got["seconds_all"]) == 3
    assert got["timed_compiles"] == 0 and got["compiles"] == [0, 0, 0]


@pytest.fixture
def fresh_compiles(monkeypatch):
    """gpucheck/compiles.py with its counts at zero and Triton's hooks as a test sets them (restored after)."""
    import importlib

    knobs = pytest.importorskip("triton").knobs
    from rlspec.bench.gpucheck import compiles

    for hook in ("jit_cache_hook", "jit_post_compile_hook"):
        monkeypatch.setattr(knobs.runtime, hook, None)
    importlib.reload(compiles)
    yield compiles, knobs.runtime
    importlib.reload(compiles)


def _compile(runtime, kernel: str):
    """What Triton's JIT does around one compile (runtime/jit.py, _do_compile): the cache hook (a truthy answer
    skips the compile), the compile, then the post-compile hook."""
    info = dict(key=kernel, repr=kernel, fn=type("Info", (), {"name": kernel})(), compile={}, is_manual_warmup=False,
                already_compiled=False)
    if runtime.jit_cache_hook(**info):
        return "skipped"
    runtime.jit_post_compile_hook(**info)
    return "compiled"


def test_triton_compiles_are_counted_through_its_hooks_and_the_hooks_before_still_answer(fresh_compiles):
    compiles, runtime = fresh_compiles
    seen = []
    runtime.jit_cache_hook = lambda **kw: seen.append(kw["key"]) or kw["key"] == "_cached_elsewhere"
    assert compiles.since(compiles.mark())["counted"] is False  # nothing installed: nothing counted
    assert compiles.install() and compiles.install()  # once: a second install adds no second count
    start = compiles.mark()
    assert [_compile(runtime, k) for k in ("_few_rows", "_split", "_few_rows")] == ["compiled"] * 3
    # the hook set before ours still sees every compile, and its answer (skip this one) is Triton's answer
    assert _compile(runtime, "_cached_elsewhere") == "skipped" and seen[-1] == "_cached_elsewhere"
    got = compiles.since(start)
    assert got["counted"] and got["count"] == 3 and got["kernels"] == {"_few_rows": 2, "_split": 1}
    assert got["seconds"] >= 0
    later = compiles.mark()
    _compile(runtime, "_combine")
    assert compiles.since(later)["kernels"] == {"_combine": 1} and compiles.count() == 4


def test_the_compile_ahead_child_is_stopped_with_the_tests_and_its_log_counted(tmp_path):
    """ahead.py: the child starts over the asked sections that compile, runs until the tests end, and is then
    killed; the report counts the compiles its log lists, built apart from loaded (under compiles.LOAD_S)."""
    import argparse
    import time

    from rlspec.bench.gpucheck import ahead, compiles

    started = {}

    def child(names, args, folder, log, timeouts, ahead=False):  # gpu.child's face: a stand-in that compiles two
        started.update(names=names, folder=folder, ahead=ahead)
        lines = f"print('{compiles.LOG_PREFIX} _few_rows 0.500', flush=True); " \
                f"print('{compiles.LOG_PREFIX} _split 0.004', flush=True); " \
                f"print('{compiles.LOG_PREFIX} _comb', end='', flush=True); import time; time.sleep(60)"  # cut off
        return subprocess.Popen([sys.executable, "-c", lines], stdout=log, start_new_session=True)

    args = argparse.Namespace(sections=["tests", "plain", "profile", "oracle", "e2e", "tests_rest"])
    early = ahead.start(args, tmp_path, child)
    assert started == dict(names=["plain", "oracle"], folder=tmp_path / "ahead", ahead=True)
    deadline = time.monotonic() + 30
    while (tmp_path / "ahead.log").read_text().count(compiles.LOG_PREFIX) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    got = early.stop()
    assert time.monotonic() - t0 < 5 and early.proc.poll() is not None  # killed, not waited out
    assert got["status"] == "stopped" and got["sections"] == ["plain", "oracle"]
    assert got["triton_compiles"] == dict(count=2, built=1, seconds=0.5) and got["log"] == "ahead.log"
    assert ahead.start(argparse.Namespace(sections=["tests", "profile", "e2e"]), tmp_path, child) is None
    # the light form: the same shapes, batches and launches (what compiles), timed once, no transformers baseline
    light, full = presets.config("plain", False, ahead=True), presets.config("plain", False)
    assert light == {**full, "repeats": 1, "iters": 1, "hf_batches": []}
    assert presets.config("oracle", False, ahead=True) == {**presets.config("oracle", False), "repeats": 1}


def test_a_timed_call_that_compiled_is_flagged(fresh_compiles):
    import torch

    from rlspec.bench.gpucheck.common import timed_calls

    compiles, runtime = fresh_compiles
    compiles.install()
    eng = _Counting()
    compiled = iter([False, True, False])
    got = timed_calls(eng, lambda: (next(compiled) and _compile(runtime, "_few_rows"), eng.generate(False))[1],
                      torch.device("cpu"), 3)
    assert got["compiles"] == [0, 1, 0] and got["timed_compiles"] == 1 and got["timed_captures"] == 0


def test_the_e2e_oracle_drafts_the_successor_chain_with_probability_a():
    from rlspec.bench.gpucheck.e2e import SuccessorOracle

    succ = [(t * 7 + 3) % 101 for t in range(101)]
    d = SuccessorOracle(succ, accept=0.7, seed=1)
    kept = total = 0
    for start in range(3, 100):
        draft = d.propose([_Seq([1, 2], [start])], [4], 1)[0]
        chain, t = [], start
        for _ in range(4):
            t = succ[t]
            chain.append(t)
        kept += sum(a == b for a, b in zip(draft.tokens, chain))
        total += 4
    assert abs(kept / total - 0.7) < 0.06
    full = SuccessorOracle(succ, accept=1.0)
    assert full.propose([_Seq([9, 5], [])], [2], 1)[0].tokens == [succ[5], succ[succ[5]]]  # from the prompt's end


def test_a_failing_drafter_keeps_the_verify_rows_and_fails_the_section(tmp_path, monkeypatch):
    """spec_costs drafts first: an EAGLE-3 failure (planted) is recorded, the verify rows (the oracle's formula
    inputs) are still measured and saved, and the section still fails, so the report cannot read ok."""
    from rlspec.bench.gpucheck import spec_costs

    def planted(*args, **kwargs):
        raise ValueError("planted drafter failure")

    monkeypatch.setattr(spec_costs, "draft_rows", planted)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="planted drafter failure"):
        gpu.main(["--smoke", "--section", "spec_costs", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "spec_costs.json").read_text())
    assert saved["eagle3_error"] == "ValueError: planted drafter failure" and saved["eagle3_draft"] == []
    assert {r["tokens"] for r in saved["verify"]} >= {1, 2, 5} and "complete_s" not in saved


def _h200_report(**changes) -> dict:
    """A report of the whole check on an H200, every section complete, its figures meeting every aim; `changes`
    replaces sections."""
    ok = dict(status="ok", seconds=50.0)
    report = dict(device="NVIDIA H200", sections_run=list(presets.SECTIONS), elapsed_s=560.0,
                  **{s: dict(ok) for s in presets.SECTIONS})
    report["tests"]["seconds"] = 140.0  # the core: 140 + 50 + 50
    report["contexts"] = dict(ok, rows=[
        dict(context=256, batch=1, step_ms=3.9), dict(context=256, batch=8, step_ms=4.5),
        dict(context=256, batch=32, step_ms=5.4), dict(context=8192, batch=32, over_limit=1.25),
        dict(context=256, batch=1, step_ms=9.0, kernel="flex")])  # a comparison row after the default pass
    report["spec_costs"] = dict(ok, verify=[dict(batch=128, kind="chain", tokens=5, step_ms=20.0),
                                            dict(batch=128, kind="chain", tokens=1, step_ms=7.9)],
                                eagle3_draft=[dict(batch=b, vs_plain_step=0.09) for b in (1, 8, 32)])
    report["oracle"] = dict(ok, rows=[dict(batch=b, accept=a, vs_predicted_at_measured=0.95 if a == 0.7 else 0.1)
                                      for b in (1, 8, 32) for a in (0.5, 0.7, 0.9)])
    report.update(changes)
    return report


def test_the_aims_are_judged_on_the_figures_they_name():
    from rlspec.bench.gpucheck import aims

    got = aims.evaluate(_h200_report())
    assert got["met"] == got["of"] == 12, [r for r in got["rows"] if not r["met"]]
    values = {r["aim"]: r["value"] for r in got["rows"]}
    assert values["plain step ms, context 256, batch 1"] == 3.9  # the default pass, not the comparison after it
    assert values["plain step ms, context 256, batch 128"] == 7.9  # spec_costs' plain step: a chain of 1
    assert values["the core's seconds (tests, plain, spec_costs), each completed"] == 240.0
    # each figure past its aim is not met; a figure the report lacks is not measured (None), never met
    slow = _h200_report(oracle=dict(status="ok", rows=[dict(batch=1, accept=0.7, vs_predicted_at_measured=0.85)]))
    slow["spec_costs"]["eagle3_draft"][1]["vs_plain_step"] = 0.39
    slow["contexts"]["rows"][3]["over_limit"] = 1.92
    verdict = {r["aim"]: r["met"] for r in aims.evaluate(slow)["rows"]}
    assert [k for k, met in verdict.items() if met is False] == [
        "plain step over its limit, context 8192, batch 32", "EAGLE-3 level over a plain step, batch 8",
        "oracle a = 0.7, batch 1: decode speedup over the formula's"]
    assert verdict["oracle a = 0.7, batch 8: decode speedup over the formula's"] is None
    # the budget: the whole check's seconds, every section completed (one cut short by its limit fails it, however
    # quick), and the core's the same; a run of a few sections judges neither
    cut = aims.evaluate(_h200_report(e2e=dict(status="timeout (100 s)", seconds=100.0)))["rows"]
    assert [r["met"] for r in cut[-2:]] == [False, True]
    cut = aims.evaluate(_h200_report(tests=dict(status="failed", seconds=100.0)))["rows"]
    assert [r["met"] for r in cut[-2:]] == [False, False]
    over = aims.evaluate(_h200_report(elapsed_s=610.0))["rows"]
    assert over[-2]["met"] is False and over[-1]["met"] is True
    some = aims.evaluate(_h200_report(sections_run=["plain", "contexts"]))["rows"]
    assert [r["met"] for r in some[-2:]] == [None, None] and some[0]["met"] is True
    assert "not measured" in "\n".join(aims.lines(aims.evaluate(slow)))
    # sections that failed before writing their rows, or wrote something else, leave their aims unmeasured
    broken = aims.evaluate(_h200_report(profile="failed", contexts=dict(status="failed (exit 1)", seconds=3.0),
                                        oracle="failed",
                                        spec_costs=dict(status="ok", verify=None, eagle3_draft={"error": "x"})))
    assert sum(r["value"] is None for r in broken["rows"]) == 10
    assert [r["met"] for r in broken["rows"][-2:]] == [False, True]  # the core's three sections completed
    assert aims.evaluate({**_h200_report(), "device": "NVIDIA H100 80GB HBM3"}) == {
        "skipped": "the aims are set for an H200; this report is from NVIDIA H100 80GB HBM3"}
