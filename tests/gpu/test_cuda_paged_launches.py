"""The paged decode attention (model/paged_decode.py) at every launch the device check's `contexts` section times
besides the default (other tiles, pipeline depths, programs an SM): the same attention as the dense reference, so a
faster one can be made the default on its timing alone. Outside the check's core (its compiles are the check's
time): tests_rest runs it."""
import pytest
import torch

from tests.rollout.runtime import test_paged_decode as cpu_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
paged_decode = pytest.importorskip("rlspec.rollout.runtime.model.paged_decode", reason="needs triton")


def test_cuda_kernel_is_the_dense_reference_at_every_launch_the_check_times(monkeypatch):
    from rlspec.bench.gpucheck.presets import GPU

    monkeypatch.setattr(cpu_cases, "BS", 128)  # the CUDA pool's block (attention.BLOCK)
    starts = [3, 127, 128, 2047, 2100]
    args, ref = cpu_cases._case(len(starts), 28, 4, 128, 1, starts, torch.bfloat16, False)
    for keys, stages, per_sm in GPU["contexts"]["attention"]["launches"]:
        got = paged_decode.paged_decode(*args, keys=keys, stages=stages, per_sm=per_sm)
        torch.testing.assert_close(got.double().cpu(), ref, atol=3e-2, rtol=0)
