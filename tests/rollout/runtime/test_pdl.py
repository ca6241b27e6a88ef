"""When our Triton kernels launch with programmatic dependent launch (model/pdl.py): only on CUDA devices of
compute capability 9 and later, while enabled, and after a self-test passed there, which never runs inside a
capture; a self-test that fails or finds other results warns and leaves PDL off. (On sm_90 the kernels compile with
its wait first thing: test_triton_aot.py; the self-test and graphs replaying PDL launches run on CUDA in
tests/gpu/test_cuda_triton.py.)"""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 before triton is imported)", allow_module_level=True)
pdl = pytest.importorskip("rlspec.rollout.runtime.model.pdl", reason="needs triton")

CUDA0 = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # what serves() reads of a CUDA tensor


@pytest.fixture
def device(monkeypatch):
    """A stand-in CUDA device 0: its capability and capture state set by the test, the self-test counted."""
    state = SimpleNamespace(capability=(9, 0), capturing=False, tests=[], passes=True)
    monkeypatch.setattr(pdl, "_passed", {})
    monkeypatch.setattr(pdl, "enabled", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: state.capability)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(pdl, "_self_test", lambda dev: state.tests.append(dev) or state.passes)
    return state


def test_only_cuda_tensors_take_it():
    assert not pdl.serves(torch.ones(2))


def test_hopper_takes_it_once_its_self_test_passed(device):
    device.capturing = True  # a capture first: no self-test inside it, and this launch goes without
    assert not pdl.serves(CUDA0) and device.tests == [] and pdl.status() == {}
    device.capturing = False
    assert pdl.serves(CUDA0) and pdl.serves(CUDA0) and device.tests == [torch.device("cuda", 0)]  # tested once
    device.capturing = True
    assert pdl.serves(CUDA0) and pdl.status() == {0: True}  # inside later captures too
    pdl.enabled = False  # RLSPEC_PDL=0, or the device check's comparison
    assert not pdl.serves(CUDA0) and pdl.status() == {0: False}


def test_older_devices_and_a_failed_self_test_go_without(device):
    device.capability = (8, 0)
    assert not pdl.serves(CUDA0) and device.tests == [] and pdl.status() == {0: False}
    pdl._passed.clear()
    device.capability, device.passes = (9, 0), False
    assert not pdl.serves(CUDA0) and not pdl.serves(CUDA0) and len(device.tests) == 1


@pytest.fixture
def chain_on_cpu(monkeypatch):
    """The self-test's kernel through Triton's interpreter, which cannot run PDL's wait: launched without."""
    real = pdl.halves
    monkeypatch.setattr(pdl, "halves", lambda x, dependent: real(x, False))


def test_a_triton_without_it_goes_without(device, monkeypatch):
    """A Triton before 3.4 has no grid dependency control: no PDL, and the launch options name none (such a Triton
    refuses an option it does not know)."""
    monkeypatch.setattr(pdl, "gdc_wait", None)
    assert not pdl.serves(CUDA0) and device.tests == [] and pdl.launch(False) == {"PDL": False}
    assert pdl.launch(True) == {"PDL": True, "launch_pdl": True}


def test_the_self_test_warns_where_a_launch_or_capture_fails(chain_on_cpu):
    """On this machine the capture itself fails (no CUDA): the self-test says so and reports False."""
    with pytest.warns(RuntimeWarning, match="failed its self-test.*CUDA"):
        assert not pdl._self_test(torch.device("cpu"))


def test_the_self_test_compares_what_the_graph_replays(monkeypatch, chain_on_cpu):
    """A graph that does not replay what was captured (here: nothing at all) leaves other values than the chain
    run again on the new inputs: PDL off, with a warning."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: contextlib.nullcontext())
    with pytest.warns(RuntimeWarning, match="other results"):
        assert not pdl._self_test(torch.device("cpu"))
