"""Chains drafted on the device, looked ahead (rollout/chains_ahead.py; on by default where the device runs steps while
the host works, CUDA; switched on here): each step's successor is built from its results on the device and launched
before the host reads it, with the same tokens, finish reasons, drafts and acceptance as the step-by-step loop,
greedy and with keyed draws, as rows end by a stop token and by length; the device's texts are the host's after every
step; one host transfer a step; and no look-ahead where a row lacks room, the draws follow the batch, or the drafter
drafts on the host."""
from __future__ import annotations

import pytest
import torch

from rlspec.rollout.chains_ahead import AheadChains
from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.speculation.drafters.ngram_device import DeviceNgramDrafter
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import random_prompts


def target(device: str = "cpu"):
    from rlspec.bench.host import tiny_model  # peaked logits: rollouts repeat themselves, so n-grams match

    return tiny_model(3, device)


def launched_ahead(monkeypatch, carried: list | None = None) -> list[bool]:
    """Per chain step that could have had a successor: whether one was launched before the host read it (carried:
    one entry for each launched with rows that had ended riding along)."""
    seen, real = [], AheadChains._chain_ahead

    def spy(self, live, *a):
        out = real(self, live, *a)
        seen.append(out is not None)
        if carried is not None and out is not None and any(s.finished for s in live):
            carried.append(sum(s.finished for s in live))
        return out

    monkeypatch.setattr(AheadChains, "_chain_ahead", spy)
    return seen


def run(look_ahead: bool, params: SamplingParams, prompts, keys=None, eos=(2,), drafter="ngram_device",
        device="cpu", rows: int = 6, **kw):
    spec = SpecConfig(drafter=drafter, selector="always", num_draft_tokens=4, online_training=False)
    engine = RolloutEngine(target(device), None, spec=spec, eos_token_ids=list(eos), max_num_seqs=rows, **kw)
    engine.look_ahead = look_ahead
    out = engine.generate(prompts, params, sample_keys=keys)
    return [(r.completion_ids, r.logprobs, r.finish_reason) for r in out], engine


def accept_stats(engine) -> dict:
    return {k: v for k, v in engine.stats().items() if k.startswith("rollout/accept")}


@pytest.mark.parametrize("keyed", [False, True])
def test_chains_looked_ahead_give_the_step_by_step_rollouts(keyed, monkeypatch):
    assert_same_rollouts(keyed, "cpu", monkeypatch)


def assert_same_rollouts(keyed: bool, device: str, monkeypatch) -> None:
    """Rows ending at different steps (a stop token some rows meet, and the length): greedy, or sampled with keyed
    draws, the looked-ahead rollouts equal the step-by-step ones in every token and finish reason, with their
    logprobs to rounding, one host transfer a step, the same acceptance, and most chain steps launched ahead, in the
tail with rows that ended riding along. After every
    committed step the device holds each row's text as the host does (a stop token or the budget ends it there too).
    (tests/gpu/test_cuda_chains_ahead.py: the same on CUDA, its graphs replayed.)"""
    prompts = random_prompts(10, 8, 16, seed=0, vocab=64)
    params = SamplingParams(temperature=1.0 if keyed else 0.0, max_new_tokens=50, n=2)
    keys = list(range(100, 120)) if keyed else None
    free, _ = run(False, params, prompts, keys, eos=(), device=device, rows=16)
    rows = [ids for ids, _, _ in free]
    # a stop token past the start of some rows and absent from others: rows end early, and by length
    stops = [next(t for t in rows[0][8:] if sum(t in r for r in rows) < len(rows) // 2)]
    want, plain = run(False, params, prompts, keys, eos=stops, device=device, rows=16)
    carried = []
    seen, texts = launched_ahead(monkeypatch, carried), {"rows": 0, "ended": 0}
    appended = DeviceNgramDrafter.appended

    def checked(self, seqs):  # every row's text, the ones a step ago ended too (their slots stay for siblings)
        appended(self, seqs)
        for s, slot, _, _ in self._state.values():
            assert self.buf[slot, :int(self.lens[slot])].tolist() == s.all_ids()
            texts["rows"] += 1
            texts["ended"] += s.finished
    monkeypatch.setattr(DeviceNgramDrafter, "appended", checked)
    got, ahead = run(True, params, prompts, keys, eos=stops, device=device, rows=16)
    assert [(ids, why) for ids, _, why in got] == [(ids, why) for ids, _, why in want]
    torch.testing.assert_close([lp for _, lp, _ in got], [lp for _, lp, _ in want], rtol=0, atol=1e-5)
    assert {why for _, _, why in got} == {"stop", "length"}
    # one host transfer a step (a row's end is learned a step late, so groups may be admitted a step later)
    steps = len(ahead.batch_trace) - len(plain.batch_trace)
    assert ahead.runner.transfers.counts["d2h"] - plain.runner.transfers.counts["d2h"] == steps >= 0
    assert ahead.runner.transfers.counts["h2d_blocking"] == 0
    stats = accept_stats(ahead)  # stats() hands the call's figures over once
    assert stats == accept_stats(plain) and stats["rollout/accept_len"] > 1.1
    assert sum(seen) > len(seen) // 2 and texts["rows"] > 100 and texts["ended"] > 0, (seen, texts)
    assert carried, carried  # in the tail, a row that ended rode along (frozen)


def test_no_look_ahead_without_keys_or_with_a_host_drafter(monkeypatch):
    """Sampling from the call's generator without keys (a row's uniforms depend on the rows a step holds), or a
    drafter that drafts on the host (suffix_device), steps one at a time."""
    seen = launched_ahead(monkeypatch)
    prompts = random_prompts(3, 8, 16, seed=1, vocab=64)
    run(True, SamplingParams(temperature=1.0, max_new_tokens=20, seed=3), prompts)
    run(True, SamplingParams(temperature=0.0, max_new_tokens=20), prompts, drafter="suffix_device")
    assert seen == []


def test_look_ahead_stops_where_a_row_lacks_room_and_under_preemption(monkeypatch):
    """A pool so small that rows are preempted: a successor is launched only where every row has the blocks for it
    (the loop preempts between runs of steps), so greedy rollouts stay the plain ones and every block comes back;
    rows near their length step one at a time."""
    prompts = random_prompts(7, 8, 16, seed=1, vocab=64)
    params = SamplingParams(temperature=0, max_new_tokens=40, n=2, ignore_eos=True)
    ref = [r.completion_ids for r in RolloutEngine(target(), None, eos_token_ids=[2]).generate(prompts, params)]
    seen = launched_ahead(monkeypatch)
    got, engine = run(True, params, prompts, eos=(2,), max_model_len=128, kv_memory_gb=2e-5)
    assert [ids for ids, _, _ in got] == ref
    assert engine.stats()["rollout/preemptions"] > 0 and any(seen) and not all(seen), seen
    assert engine.runner.cache.alloc.used == 0, "every block came back"


def test_a_look_ahead_reads_nothing_back_from_the_device(monkeypatch):
    """Launching a successor reads no device value on the host (a GPU would wait there for the step in front): with
    every way a tensor's value reaches Python made to fail while `_chain_ahead` runs, the looked-ahead rollout still
    gives the step-by-step one."""
    prompts = random_prompts(4, 8, 16, seed=3, vocab=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, n=2, ignore_eos=True)
    want, _ = run(False, params, prompts)
    trap_device_reads(monkeypatch)
    seen = launched_ahead(monkeypatch)
    got, _ = run(True, params, prompts)
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want] and sum(seen) > 10, seen


def trap_device_reads(monkeypatch) -> None:
    """Make every way a tensor's value reaches Python fail while `AheadChains._chain_ahead` runs (it builds and
    launches a successor)."""
    reads = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu")
    real, inside = AheadChains._chain_ahead, [False]

    def trapped(self, *a):
        inside[0] = True
        try:
            return real(self, *a)
        finally:
            inside[0] = False

    for name in reads:
        method = getattr(torch.Tensor, name)

        def guarded(t, *a, _name=name, _method=method, **kw):
            assert not inside[0], f"Tensor.{_name} read a device value while a successor was launched"
            return _method(t, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    monkeypatch.setattr(AheadChains, "_chain_ahead", trapped)
