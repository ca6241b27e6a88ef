"""Calibration measured once per machine, model and runner mode (rollout/speculation/calibration_cache.py):
a second engine loads the table instead of timing forwards; another key (dtype, threads, verify sizes)
calibrates again; buckets the file lacks are timed and added; a corrupt file is ignored with a warning."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from rlspec.rollout.engine import RolloutEngine
from rlspec.rollout.runtime.model import loader
from rlspec.rollout.speculation.calibration_cache import cache_file, calibration_key
from rlspec.rollout.speculation.selectors.adaptive import AdaptiveSelector
from rlspec.rollout.speculation.selectors.base import Arm
from rlspec.rollout.speculation.speculation import Speculation
from rlspec.rollout.types import SamplingParams, SpecConfig
from tests.conftest import make_tiny_hf, random_prompts


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSPEC_CALIBRATION_CACHE", str(tmp_path))
    return tmp_path


def count_steps(runner) -> list[int]:
    """runner.step calls from now on (one entry per call: its batch size)."""
    calls, step = [], runner.step

    def spy(tokens, start, *args, **kw):
        calls.append(tokens.shape[0])
        return step(tokens, start, *args, **kw)

    runner.step = spy
    return calls


def suffix_engine(hf, **kw) -> RolloutEngine:
    spec = SpecConfig(drafter="suffix", selector="adaptive", num_draft_tokens=4)
    return RolloutEngine(loader.from_hf_model(hf), None, spec=spec, eos_token_ids=[2], max_num_seqs=8, **kw)


def calibrate(eng) -> list[int]:
    """Run the engine's calibration as generate() does; the batch sizes of the forwards it timed."""
    cache = eng.runner.ensure_cache(8, 128, eng.speculation.extra_kv_layers)
    calls = count_steps(eng.runner)
    eng.speculation.calibrate(eng.runner, cache.rows, cache.length)
    eng.runner.step = type(eng.runner).step.__get__(eng.runner)
    return calls


def test_the_second_engine_loads_the_table_instead_of_timing(cache):
    hf = make_tiny_hf("llama", seed=31)
    first = suffix_engine(hf)
    assert calibrate(first)  # timed
    table = dict(first.selector.costs.table)
    assert {b for b, _ in table} == {1, 2, 4, 8} and len(list(cache.glob("*.json"))) == 1
    second = suffix_engine(hf)
    assert calibrate(second) == []  # not one forward
    assert second.selector.costs.table == table
    # and a real call goes through with the loaded table
    out = second.generate(random_prompts(2, 4, 8), SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    assert len(out) == 2


def test_another_key_calibrates_again(cache, monkeypatch):
    hf = make_tiny_hf("llama", seed=32)
    calibrate(suffix_engine(hf))
    other_dtype = RolloutEngine(loader.from_hf_model(hf, dtype=torch.bfloat16), None, eos_token_ids=[2], max_num_seqs=8,
                                spec=SpecConfig(drafter="suffix", selector="adaptive", num_draft_tokens=4),
                                compile_mode="off")  # bf16 alone is another key; its compiles would be seconds of C++
    assert calibrate(other_dtype)
    deeper = RolloutEngine(loader.from_hf_model(hf), None, eos_token_ids=[2], max_num_seqs=8,
                           spec=SpecConfig(drafter="suffix", selector="adaptive", num_draft_tokens=8))
    assert calibrate(deeper)  # other verify sizes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another machine, as far as the key knows
    assert calibrate(suffix_engine(hf))
    assert len(list(cache.glob("*.json"))) == 4


def test_buckets_the_file_lacks_are_timed_and_added(cache):
    hf = make_tiny_hf("llama", seed=33)
    small = suffix_engine(hf)
    small.runner.ensure_cache(2, 128)
    calls = count_steps(small.runner)
    small.speculation.calibrate(small.runner, 2, 128)  # buckets 1, 2
    assert set(calls) == {1, 2}
    big = suffix_engine(hf)
    assert set(calibrate(big)) == {4, 8}  # only the buckets it did not find
    assert calibrate(suffix_engine(hf)) == []


def test_a_later_larger_call_calibrates_the_buckets_it_reaches_first(cache):
    """One engine, a call of 2 sequences then one of 4: bucket 4 is timed when the second call starts, even
    though the table holds entries for it by then (verify steps observed there). Its plain cost was read off
    the smallest verify observed before (about twice a plain step: every draft looked twice as good)."""
    hf = make_tiny_hf("llama", seed=36)
    eng = suffix_engine(hf)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    eng.generate(random_prompts(2, 4, 8), params)
    costs = eng.selector.costs
    assert (1, 1) in costs.table and (2, 1) in costs.table and not any(b == 4 for b, _ in costs.table)
    costs.observe(4, 5, 1.0)  # a verify step seen in bucket 4 (absurdly slow): no plain cost there yet
    calls = count_steps(eng.runner)
    eng.generate(random_prompts(4, 4, 8, seed=1), params)
    eng.runner.step = type(eng.runner).step.__get__(eng.runner)
    assert (4, 1) in costs.table and costs.cost(4, 1) < 0.5
    assert 4 in calls[:3]  # timed before the call's first step
    (path,) = cache.glob("*.json")
    assert {b for b, _, _ in json.loads(path.read_text())["table"]} == {1, 2, 4}  # and went into the file


def test_the_top_bucket_of_rows_that_are_no_power_of_two_is_timed_at_those_rows(cache):
    """6 rows reach bucket 8 (live batches 5-6): it is calibrated, at 6 rows, not left to the first verify
    steps observed there (whose widths then stretched linearly to the arms' larger verifies)."""
    eng = suffix_engine(make_tiny_hf("llama", seed=39))
    eng.runner.ensure_cache(6, 128)
    calls = count_steps(eng.runner)
    eng.speculation.calibrate(eng.runner, 6, 128)
    assert set(calls) == {1, 2, 4, 6} and {b for b, _ in eng.selector.costs.table} == {1, 2, 4, 8}


def test_a_corrupt_file_is_ignored_with_a_warning(cache, caplog):
    hf = make_tiny_hf("llama", seed=34)
    eng = suffix_engine(hf)
    calibrate(eng)
    (path,) = cache.glob("*.json")
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="rlspec.rollout.speculation.calibration_cache"):
        assert calibrate(suffix_engine(hf))
    assert "ignoring the calibration cache file" in caplog.text
    assert json.loads(path.read_text())["table"]  # rewritten whole
    assert calibrate(suffix_engine(hf)) == []


def test_a_file_of_another_key_is_not_trusted(cache, caplog):
    """A file at the key's path whose stored key differs (a hash collision, a hand-copied file)."""
    hf = make_tiny_hf("llama", seed=35)
    eng = suffix_engine(hf)
    calibrate(eng)
    (path,) = cache.glob("*.json")
    saved = json.loads(path.read_text())
    saved["key"]["dtype"] = "torch.float64"
    path.write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="rlspec.rollout.speculation.calibration_cache"):
        assert calibrate(suffix_engine(hf))
    assert "another key" in caplog.text


def test_off_times_every_engine(monkeypatch):
    monkeypatch.setenv("RLSPEC_CALIBRATION_CACHE", "off")
    hf = make_tiny_hf("llama", seed=36)
    assert calibrate(suffix_engine(hf)) and calibrate(suffix_engine(hf))
    assert cache_file({"any": "key"}) is None


def _ready(eng):
    eng.runner.ensure_cache(8, 128)
    return eng.runner


def test_key_names_machine_model_mode_and_sizes():
    eng = suffix_engine(make_tiny_hf("llama", seed=37))
    key = calibration_key(_ready(eng), [5, 1, 3, 5], 64)
    assert key["sizes"] == [1, 3, 5] and key["context"] == 64
    assert key["machine"]["threads"] == torch.get_num_threads() and key["machine"]["cores"]
    assert key["dtype"] == "torch.float32" and key["steps"] and "compiled" in key and key["fused"] is None
    assert len(key["model"]) == 64  # a sha256 of the model's configuration


def test_a_restored_table_is_neither_timed_nor_cached(cache):
    eng = suffix_engine(make_tiny_hf("llama", seed=38))
    spec = Speculation({}, AdaptiveSelector([Arm("suffix", 2)]))
    for b in (1, 2, 4):  # a resumed engine: its table came with the checkpoint
        spec.selector.costs.table[(b, 1)] = 0.5
    calls = count_steps(_ready(eng))
    spec.calibrate(eng.runner, 4, 128)
    assert calls == [] and list(cache.glob("*.json")) == []
    spec.calibrate(eng.runner, 8, 128)  # a bucket the checkpoint never reached is timed (and cached)
    assert set(calls) == {8} and len(list(cache.glob("*.json"))) == 1
