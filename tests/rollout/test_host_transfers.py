"""The decode loop keeps vocabulary-sized tensors on the engine's device.

Two checks. Static (ast, nothing runs): in the engine's decode-loop stages, in verification, in
sampling and in the learned drafter, no call moves a tensor to the host (`.cpu()`, `.tolist()`, `.item()`,
`.numpy()`, `.nonzero()`, `.to("cpu")`) except the funnel's one `.tolist()` per step
(runtime/transfers.py `Pending.rows`). Dynamic:
a speculative generate (sampled EAGLE-3 drafts, trees) with every host-transfer method of
torch.Tensor wrapped, asserting that no transfer carries as many numbers as one vocabulary row.
On CPU the "transfers" are no-ops, but the calls are the same ones a GPU would pay for.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts

ROOT = Path(__file__).resolve().parents[2]
HOST_METHODS = {"cpu", "tolist", "item", "numpy", "nonzero"}
DECODE_STAGES = {"_decode_step", "_propose", "_verify", "_send", "_read", "_commit", "_retire", "_prefill", "read",
                 "send"}
# (file, function) -> host calls allowed there: the one packed transfer of each step; outside the decode loop's path,
# the drafts' host form (the loop takes DraftTensors) and a checkpoint's copy of the drafter
ALLOWED = {("rollout/runtime/transfers.py", "rows"): {"tolist"},
           ("rollout/speculation/drafters/base.py", "to_drafts"): {"tolist"},
           ("rollout/speculation/drafters/eagle3.py", "state_dict"): {"to"}}
FILES = ["rollout/engine.py", "rollout/decode.py", "rollout/chains_ahead.py", "rollout/step_layout.py",
         "rollout/runtime/transfers.py",
         "rollout/speculation/verify.py", "rollout/runtime/sampling.py", "rollout/speculation/draft_batch.py",
         "rollout/speculation/strategies.py", "rollout/lossy/control.py", "rollout/lossy/judge.py", "rollout/lossy/law.py",
         "rollout/lossy/heads.py", "rollout/lossy/router.py", "rollout/runtime/history.py",
         "rollout/speculation/drafters/base.py", "rollout/speculation/drafters/eagle3.py",
         "rollout/speculation/drafters/eagle3_draws.py", "rollout/speculation/drafters/eagle3_graphs.py",
         "rollout/speculation/drafters/eagle3_catch_up.py", "rollout/speculation/drafters/ngram_device.py",
         "rollout/speculation/drafters/suffix_device.py"]


def host_calls(path: str) -> list[tuple[str, int, str]]:
    """(enclosing function, line, method) for every call of a HOST_METHODS method or of .to("cpu") in a file."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                        node.func.attr in HOST_METHODS or node.func.attr == "to" and any(
                            isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args)):
                    found.append((fn.name, node.lineno, node.func.attr))
    return found


@pytest.mark.parametrize("path", FILES)
def test_no_host_transfers_in_the_decode_path(path):
    checked = DECODE_STAGES if path in ("rollout/engine.py", "rollout/decode.py", "rollout/step_layout.py") else None
    bad = [(fn, line, m) for fn, line, m in host_calls(path)
           if (checked is None or fn in checked) and m not in ALLOWED.get((path, fn), set())]
    assert not bad, f"{path}: host transfers in the decode loop (use the runner's Transfers once per step): {bad}"


def test_static_check_sees_the_one_allowed_transfer(tmp_path, monkeypatch):
    assert ("rows", "tolist") in {(fn, m) for fn, _, m in host_calls("rollout/runtime/transfers.py")}
    planted = tmp_path / "rollout" / "decode.py"  # and it sees planted ones of every kind
    planted.parent.mkdir()
    planted.write_text("def _send(x):\n    return x.argmax(-1).tolist(), x.cpu(), x.nonzero(), x.to('cpu'), "
                       "x.to(x.device)\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert [m for _, _, m in host_calls("rollout/decode.py")] == ["tolist", "cpu", "nonzero", "to"]


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "repetition_penalty"])
def test_no_vocabulary_sized_tensor_reaches_the_host(monkeypatch, penalty):
    """With a repetition penalty the per-row token sets and every node's history stay on the device too."""
    vocab = 2048  # larger than any bookkeeping transfer of this batch (8 rows x (2 x 6 nodes + 3))
    hf = make_tiny_hf("llama", seed=3, vocab=vocab)
    spec = SpecConfig(drafter="eagle3", selector="always", num_draft_tokens=3, tree_width=2, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2])
    sizes: list[int] = []
    for name in HOST_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _original=original, **kw):
            sizes.append(self.numel())
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=0, repetition_penalty=penalty, min_p=0.01)
    eng.generate(random_prompts(4, 3, 8, seed=3, vocab=vocab), params)
    monkeypatch.undo()
    assert eng.stats()["rollout/spec_step_share"] > 0.5  # speculative steps (trees of sampled drafts) ran
    assert sizes, "the wrapper saw no transfer at all: it is not wired"
    assert max(sizes) < vocab, f"a transfer of {max(sizes)} numbers (vocabulary {vocab})"


def _count_transfers(monkeypatch) -> list[int]:
    """Wrap every host-transfer method of torch.Tensor; the returned list grows by one per call."""
    calls: list[int] = []
    for name in HOST_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _original=original, **kw):
            calls.append(self.numel())
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return calls


def test_one_transfer_per_step_finite_check_included(monkeypatch):
    """Plain decoding makes exactly one transfer per prefill and per decode step: the per-row "logits
    finite" flag rides in it. With a NaN weight the error is raised from that same transfer (counted up to
    the moment the error is built; finding the culprit afterwards may cost what it likes)."""
    import rlspec.rollout.decode as decode_module
    from rlspec.rollout.errors import NonFiniteLogitsError

    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=3)), None, eos_token_ids=[2])
    prompts, params = random_prompts(4, 3, 8, seed=3), SamplingParams(temperature=1.0, max_new_tokens=10, seed=0)
    calls = _count_transfers(monkeypatch)
    eng.generate(prompts, params)
    steps = len(eng.batch_trace)
    assert len(calls) == 1 + steps, f"{len(calls)} transfers for one prefill and {steps} decode steps"
    calls.clear()
    with torch.no_grad():
        eng.model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    at_error: list[int] = []
    real = decode_module.nonfinite_error
    monkeypatch.setattr(decode_module, "nonfinite_error", lambda *a: at_error.append(len(calls)) or real(*a))
    with pytest.raises(NonFiniteLogitsError):
        eng.generate(prompts, params)
    assert at_error == [1], "the prefill's one transfer must carry the check"


def test_penalty_adds_no_transfer(monkeypatch):
    """A repetition penalty under speculation (chains of scripted drafts, every step) still makes one
    transfer per prefill and per decode step: histories are marked and read on the device."""
    from rlspec.rollout.speculation.selectors.base import Arm
    from tests.conftest import TINY_VOCAB
    from tests.rollout.spec_helpers import ScriptedDrafter

    spec = SpecConfig(drafter="ngram", num_draft_tokens=3, max_spec_batch=10_000)
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=3)), None, spec=spec, eos_token_ids=[2],
                        drafter=ScriptedDrafter(TINY_VOCAB, None, corrupt=0.3, seed=1))
    eng.speculation.force(Arm("scripted", 3, 1))
    prompts = random_prompts(4, 3, 8, seed=3)
    calls = _count_transfers(monkeypatch)
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=0, repetition_penalty=1.3))
    monkeypatch.undo()
    steps = len(eng.batch_trace)
    assert eng.stats()["rollout/spec_step_share"] > 0.5
    assert len(calls) == 1 + steps, f"{len(calls)} transfers for one prefill and {steps} decode steps"


LOSSY_MODES = {
    "judge-prob": dict(verification="judge", judge="prob", judge_threshold=0.02),
    "judge-learned": dict(verification="judge", judge="learned", judge_threshold=0.5),
    "routing-likelihood": dict(step_routing="arbitrage", route_threshold=-50.0, step_max_tokens=8),
    "routing-learned": dict(step_routing="arbitrage", router="learned", route_threshold=0.5, step_max_tokens=8),
}


@pytest.mark.parametrize("mode", sorted(LOSSY_MODES))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_lossy_modes_make_one_transfer_per_step_too(monkeypatch, mode, temperature):
    """The lossy verifiers' sources and behaviour logprobs ride in the step's one transfer, and the learned
    heads bank and train on the device: one transfer per prefill and per decode step, as in lossless."""
    from rlspec.rollout.lossy.judge import TARGET
    from tests.conftest import TINY_VOCAB
    from tests.rollout.lossy.helpers import lossy_engine
    from tests.rollout.spec_helpers import ScriptedDrafter

    hf = make_tiny_hf("llama", seed=5)
    eng = lossy_engine(hf, ScriptedDrafter(TINY_VOCAB, None, corrupt=0.3, seed=1), accept_off_policy=True,
                       **LOSSY_MODES[mode])
    if "learned" in mode:  # past the heads' warm-up, so the learned rules (and their training) run
        for head in (getattr(eng.verifier, "judge_head", None), getattr(eng.verifier, "router_head", None)):
            if head is not None:
                head.warmup, head.train_every = 8, 8
    prompts = random_prompts(4, 3, 12, seed=5)
    params = SamplingParams(temperature=temperature, max_new_tokens=24, n=2, seed=7)
    eng.generate(prompts, params)  # warm: the learned heads collect labels and train
    eng.batch_trace.clear()
    calls = _count_transfers(monkeypatch)
    results = eng.generate(prompts, params)
    monkeypatch.undo()
    steps = len(eng.batch_trace)
    assert len(calls) == 1 + steps, f"{mode}: {len(calls)} transfers for one prefill and {steps} decode steps"
    assert any(src != TARGET for r in results for src in r.token_source[1:]), "no draft was kept: nothing verified"


@pytest.mark.parametrize("graphs", ["off", "emulate"])
def test_a_learned_drafter_adds_no_transfer(monkeypatch, graphs):
    """Sampled EAGLE-3 chains, eager and through its CUDA path's graphs (emulated): still one transfer per prefill and
    per decode step; the drafts go from the drafter to the verify on the device."""
    from rlspec.rollout.speculation.selectors.base import Arm

    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=3)), None, spec=spec, eos_token_ids=[2])
    eng.speculation.learned.graph_mode = graphs
    eng.speculation.force(Arm("eagle3", 3))
    prompts = random_prompts(4, 3, 8, seed=3)
    calls = _count_transfers(monkeypatch)
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    steps = len(eng.batch_trace)
    assert eng.stats()["rollout/spec_step_share"] > 0.5 and steps >= 5
    assert len(calls) == 1 + steps, f"{len(calls)} transfers for one prefill and {steps} decode steps"


def _logged_transfers(monkeypatch) -> list[str]:
    """A log that notes "send" when a step's transfer is launched and "read" when the host reads it."""
    from rlspec.rollout.runtime.transfers import Pending, Transfers

    log, rows, send = [], Pending.rows, Transfers.to_host
    monkeypatch.setattr(Pending, "rows", lambda self: (log.append("read"), rows(self))[1])
    monkeypatch.setattr(Transfers, "to_host", lambda self, *a: (log.append("send"), send(self, *a))[1])
    return log


def test_a_verifys_features_and_the_next_catch_up_are_queued_behind_its_transfer(monkeypatch):
    """A learned drafter stages a speculative step's features from the verifier's counts on the device, and runs the
    next proposal's catch-up from them (eagle3_catch_up.py), after the step's transfer is launched and before the host
    reads it: on a GPU the host waits for the verify alone, and commits while the device stages and catches up (the
    other way round, the device idles through the staging's and the catch-up's host work after the read)."""
    from rlspec.rollout.runtime.kv_cache import PagedKVCache
    from rlspec.rollout.speculation.drafters.eagle3 import Eagle3Drafter
    from rlspec.rollout.speculation.selectors.base import Arm

    spec = SpecConfig(drafter="eagle3", num_draft_tokens=3, tree_width=2, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=3)), None, spec=spec, eos_token_ids=[2])
    eng.speculation.force(Arm("eagle3", 4, 2))
    eng.speculation.learned.early = True  # as on CUDA
    log, write, early = _logged_transfers(monkeypatch), PagedKVCache.write_side, Eagle3Drafter._catch_up_early
    monkeypatch.setattr(PagedKVCache, "write_side",
                        lambda self, name, *a: (log.append("stage" if name == "eagle3/features" else name),
                                                write(self, name, *a)))
    monkeypatch.setattr(Eagle3Drafter, "_catch_up_early", lambda self, *a: (log.append("catch up"), early(self, *a)))
    eng.generate(random_prompts(4, 3, 8, seed=3), SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    steps = len(eng.batch_trace)
    assert eng.stats()["rollout/spec_step_share"] > 0.5 and steps >= 5
    chunks = " ".join(log[log.index("read") + 1:]).split(" read")  # after the prefill's read: a chunk a step
    assert chunks[-1] == "" and len(chunks) == steps + 1, log
    # each step sends, stages and (after a verify of a proposal: all but a step nobody drafted in) catches up
    assert all(c.strip() in ("send stage", "send stage catch up") for c in chunks[:-1]), chunks
    assert sum(c.endswith("catch up") for c in chunks) >= steps - 2, chunks


@pytest.mark.parametrize("drafter", ["suffix", "none"], ids=["speculative", "plain"])
def test_a_finished_sample_enters_the_global_window_while_the_device_runs_the_next_step(monkeypatch, drafter):
    """Indexing a finished sample in the suffix drafter's global window (and evicting the oldest) is ~1-3 ms for a
    500-token sample: finish() only queues it, and the engine settles the queue after the next step's launch, before
    its read, on speculative and plain steps (a GPU runs the step meanwhile). The samples' own prompts index them at
    once; the window has every one of them once the call is over, as with indexing at finish."""
    from rlspec.rollout.speculation.drafters.suffix import SuffixDrafter
    from rlspec.rollout.speculation.selectors.base import OFF

    spec = SpecConfig(drafter="suffix", selector="always", num_draft_tokens=3, online_training=False)
    eng = RolloutEngine(loader.from_hf_model(make_tiny_hf("llama", seed=3)), None, spec=spec, eos_token_ids=[2])
    if drafter == "none":  # every step plain, the lean path's launches
        eng.speculation.force(OFF)
    suffix = eng.speculation.by_name["suffix"]
    log, finish, add = _logged_transfers(monkeypatch), SuffixDrafter.finish, suffix._global.add
    monkeypatch.setattr(SuffixDrafter, "finish", lambda self, seq: (log.append("finish"), finish(self, seq))[1])
    monkeypatch.setattr(suffix._global, "add", lambda *a, **kw: (log.append("index"), add(*a, **kw))[1])
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0, n=2)
    out = eng.generate(random_prompts(4, 3, 8, seed=3), params)
    ends = {len(r.completion_ids) for r in out}
    assert len(ends) > 1 and log.count("finish") == len(out)  # samples finished at different steps
    assert log.count("index") < len(out)  # the last step's finishes wait for the next launch (or call)
    for i, what in enumerate(log):
        if what == "index":  # indexed after a step's transfer was sent and before the host read it
            before = [w for w in log[:i] if w in ("send", "read")]
            assert before[-1] == "send", log
    assert suffix.sizes()["global_docs"] == len(out)  # settled when asked: every finished sample
