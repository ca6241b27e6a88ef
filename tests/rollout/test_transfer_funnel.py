"""Every host <-> device copy of the decode loop goes through one funnel (rollout/runtime/transfers.py).

Dynamic: a real generate, plain and speculative (chains and trees, keyed draws), counted through the runner's
Transfers: one device-to-host transfer per prefill and per decode step, and every host-to-device copy made the
non-blocking way (pinned staging where CUDA is, the same code path elsewhere). Static (ast): the decode loop's files
build no device tensor from host values outside the funnel (`torch.tensor(..., device=...)`, `.to(device)` of a
host tensor), so a copy added there cannot bypass the count. (Reads of the device on the host outside the funnel:
tests/rollout/test_host_transfers.py.)
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from rlspec.rollout.decode import DecodeSteps
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime import transfers as transfers_module
from rlspec.rollout.runtime.transfers import Transfers, host_tensor
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts

ROOT = Path(__file__).resolve().parents[2]
# the files whose code runs inside the decode loop and may copy between host and device
LOOP_FILES = ["rollout/decode.py", "rollout/step_layout.py", "rollout/speculation/draft_batch.py",
              "rollout/runtime/kv_cache.py", "rollout/runtime/kv_ledger.py", "rollout/runtime/draws.py",
              "rollout/runtime/history.py", "rollout/speculation/verify.py", "rollout/speculation/strategies.py",
              "rollout/speculation/drafters/eagle3.py", "rollout/speculation/drafters/eagle3_draws.py",
              "rollout/speculation/drafters/eagle3_graphs.py", "rollout/speculation/drafters/eagle3_catch_up.py",
              "rollout/speculation/drafters/base.py", "rollout/speculation/drafters/ngram_device.py",
              "rollout/speculation/drafters/suffix_device.py"]
# (file, function): host tensors built there on purpose (a fallback without a funnel; a prefill's reset)
ALLOWED = {("rollout/runtime/kv_cache.py", "ints"), ("rollout/runtime/draws.py", "bind"),
           ("rollout/runtime/draws.py", "__init__"),  # a call's keys, once before its loop
           ("rollout/runtime/history.py", "move_rows"), ("rollout/runtime/history.py", "reset")}

MODES = {
    "plain": None,
    "chain": dict(drafter="ngram", selector="always", num_draft_tokens=4),
    "tree": dict(drafter="ngram", selector="always", num_draft_tokens=4, tree_width=2),
    "ngram_device": dict(drafter="ngram_device", selector="always", num_draft_tokens=4),
    "suffix_device": dict(drafter="suffix_device", selector="always", num_draft_tokens=4),
    "eagle3": dict(drafter="eagle3", selector="always", num_draft_tokens=4),  # its CUDA path's graphs, emulated
}


class Counted(Transfers):
    """Transfers that also records, per copy, whether it went the non-blocking way."""

    def __init__(self, device):
        super().__init__(device)
        self.h2d_blocking = 0

    def to_device(self, values, dtype=torch.long):
        out = super().to_device(values, dtype)
        # a copy is blocking when the result is a device tensor built from pageable memory: the funnel's CUDA path
        # copies from pinned staging with non_blocking=True, and on the CPU nothing is copied at all
        if self.cuda and not out.is_cuda:
            self.h2d_blocking += 1
        return out


def engine_for(mode: str) -> RolloutEngine:
    from rlspec.bench.host import tiny_model  # peaked logits: sampled rollouts repeat, so n-grams draft

    spec = SpecConfig(**MODES[mode], online_training=False) if MODES[mode] else None
    eng = RolloutEngine(tiny_model(3), None, spec=spec, eos_token_ids=[2])
    eng.runner.transfers = Counted(eng.runner.device)
    if eng.speculation is not None and eng.speculation.learned is not None:
        eng.speculation.learned.graph_mode = "emulate"
    return eng


@pytest.mark.parametrize("keyed", [False, True], ids=["generator", "sample_keys"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_transfer_per_step_through_the_funnel(mode, keyed, monkeypatch):
    eng = engine_for(mode)
    reads: list[int] = []
    real_rows = transfers_module.Pending.rows
    monkeypatch.setattr(transfers_module.Pending, "rows", lambda self: reads.append(1) or real_rows(self))
    again, real_again = [], DecodeSteps._plain_again  # plain steps launched from their predecessor's tokens on the
    monkeypatch.setattr(DecodeSteps, "_plain_again",  # device, with no input to copy
                        lambda self, *a: (arm := real_again(self, *a)) is not None and again.append(1) or arm)
    prompts = random_prompts(4, 8, 16, seed=3, vocab=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=0, ignore_eos=True)
    eng.generate(prompts, params, sample_keys=list(range(8)) if keyed else None)
    steps, counts = len(eng.batch_trace), eng.runner.transfers.counts
    prefills = 1  # 8 sequences fit the rows: one admission, one prefill
    assert counts["d2h"] == prefills + steps == len(reads), \
        f"{mode}: {counts['d2h']} device-to-host transfers ({len(reads)} read) for {steps} decode steps"
    assert counts["h2d"] >= steps - len(again), f"{mode}: the steps' inputs did not go through the funnel"
    assert (len(again) > steps // 2) == (mode == "plain"), f"{mode}: {len(again)} of {steps} plain steps chained"
    assert eng.runner.transfers.h2d_blocking == 0
    if mode != "plain":
        assert eng.stats()["rollout/spec_step_share"] > 0.2, "no drafts: the speculative path did not run"


def test_a_stop_rule_reads_its_drafts_lengths_once_a_proposal(monkeypatch):
    """Under a stop rule the learned drafter's kept lengths size the verify, so each proposal reads them through the
    funnel: one more transfer a drafted step, its tokens still on the device."""
    from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
    from rlspec.rollout.speculation.selectors.base import Arm

    eng = engine_for("eagle3")
    eng.speculation.force(Arm("eagle3", 4, 1, "max_conf"))
    proposals, draft = [], Eagle3Drafter._draft
    monkeypatch.setattr(Eagle3Drafter, "_draft", lambda self, *a: proposals.append(1) or draft(self, *a))
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=0, ignore_eos=True)
    eng.generate(random_prompts(4, 8, 16, seed=3, vocab=64), params)
    assert len(proposals) >= 5
    assert eng.runner.transfers.counts["d2h"] == 1 + len(eng.batch_trace) + len(proposals)
    assert eng.runner.transfers.h2d_blocking == 0


def device_tensors_from_host(path: str) -> list[tuple[str, int]]:
    """(function, line) of every torch.tensor(..., device=...) call and every .to(<device>) of a freshly built host
    tensor in a file."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            built = node.func.attr == "tensor" and getattr(node.func.value, "id", None) == "torch"
            if built and any(k.arg == "device" for k in node.keywords):
                found.append((fn.name, node.lineno))
            inner = node.func.value
            if node.func.attr == "to" and isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
                    and inner.func.attr == "tensor":
                found.append((fn.name, node.lineno))
    return found


@pytest.mark.parametrize("path", LOOP_FILES)
def test_no_copy_to_the_device_outside_the_funnel(path):
    bad = [(fn, line) for fn, line in device_tensors_from_host(path) if (path, fn) not in ALLOWED]
    assert not bad, f"{path}: host values copied to the device outside runtime/transfers.py's funnel: {bad}"


def test_static_check_sees_a_planted_copy(tmp_path, monkeypatch):
    """The static check is able to fail: a planted torch.tensor(..., device=...) is found."""
    planted = tmp_path / "rollout" / "decode.py"
    planted.parent.mkdir()
    planted.write_text("import torch\n\ndef _decode_step(x):\n    return torch.tensor([1], device=x.device)\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert device_tensors_from_host("rollout/decode.py") == [("_decode_step", 4)]


@pytest.mark.parametrize("values, dtype", [
    ([5, 0, 7], torch.long), ([[1, 2, 3], [4, 5, 6]], torch.long), ([(1, 2), (3, 4)], torch.long),
    ([True, False, True], torch.long), ([[0.5, -1.0]], torch.float32), ([[1, 2]], torch.int32),
    ([[1.0, 2.5]], torch.float64), ([2**40, -3], torch.long),
    # not packed through array: empty, deeper, floats for integers, a dtype array has no code for
    ([], torch.long), ([[]], torch.long), ([[[1, 2]], [[3, 4]]], torch.long), ([1.7, 2.2], torch.long),
    ([1, 0], torch.bool)])
def test_host_tensor_is_torch_tensor(values, dtype):
    """The funnel's packing of host lists (array's buffer) gives what torch.tensor gives: values, shape and dtype."""
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_host_tensor_refuses_ragged_rows():
    """Rows of different lengths are an error, as torch.tensor says, never a reshaped guess (equal totals too)."""
    with pytest.raises(ValueError):
        host_tensor([[1, 2], [3], [4, 5, 6]])
