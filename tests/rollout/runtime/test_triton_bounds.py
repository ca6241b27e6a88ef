"""The interpreter's bounds check (tests/triton_bounds.py), which tests/conftest.py turns on for every kernel the
suite runs through Triton's interpreter: an access past a launch's tensors, or past a view into a larger one, is
refused and recorded; accesses inside them, masked-off ones and views of one tensor are not; and a launch of our
own product kernel that claims one output row more than its weight has is caught."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests import triton_bounds

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("checks Triton's interpreter (TRITON_INTERPRET=1, no GPU)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="needs triton")
tl = triton.language


@triton.jit
def _copy(X, Y, n, reach):
    """Y[i] = X[i] for i < n, loading X under the mask i < reach (reach > n: past the end of X)."""
    i = tl.arange(0, 16)
    tl.store(Y + i, tl.load(X + i, mask=i < reach, other=0.0), mask=i < n)


@pytest.fixture
def recorded():
    """The violations the test's own launches recorded (taken here, so the suite's check sees none of them)."""
    triton_bounds.take()
    seen: list[str] = []
    yield seen
    seen += triton_bounds.take()


def _launch(x, y, n, reach, recorded):
    before = triton_bounds.checked[0]
    try:
        _copy[(1,)](x, y, n, reach)
    except Exception:  # noqa: BLE001 - the interpreter wraps the check's IndexError
        pass
    recorded += triton_bounds.take()
    assert triton_bounds.checked[0] > before  # the launch's accesses went through the check


def test_inside_and_masked_off_accesses_pass(recorded):
    x, y = torch.arange(10.0), torch.zeros(10)
    _launch(x, y, 10, 10, recorded)
    assert recorded == [] and torch.equal(y, x)


def test_a_load_one_past_the_end_is_refused(recorded):
    x, y = torch.arange(10.0), torch.zeros(10)
    _launch(x, y, 10, 11, recorded)
    assert len(recorded) == 1 and recorded[0].startswith("a load of 1 element(s)")


def test_a_store_past_the_end_is_refused(recorded):
    x, y = torch.arange(16.0), torch.zeros(10)
    _launch(x, y, 12, 12, recorded)
    assert len(recorded) == 1 and recorded[0].startswith("a store of 2 element(s)")


def test_a_view_bounds_its_launch_not_its_storage(recorded):
    """Past a view's last element but inside the tensor it views: refused (on a GPU the neighbour's data, silently)."""
    base = torch.arange(20.0)
    y = torch.zeros(10)
    _launch(base[:10], y, 10, 10, recorded)
    assert recorded == []
    _launch(base[:10], y, 10, 11, recorded)
    assert len(recorded) == 1


def test_views_of_one_tensor_and_strided_views_are_spans():
    base = torch.zeros(4, 8)
    lo = base.data_ptr()
    assert triton_bounds.span(base[1]) == (lo + 32, lo + 64)
    assert triton_bounds.span(base[:, 2]) == (lo + 8, lo + 3 * 32 + 12)  # rows 0-3 of column 2
    assert triton_bounds.span(base[:0]) is None
    spans = triton_bounds.merged([triton_bounds.span(base[0]), triton_bounds.span(base[1]),
                                  triton_bounds.span(base[3])])
    assert spans.tolist() == [[lo, lo + 64], [lo + 96, lo + 128]]
    ptrs = np.array([lo, lo + 60, lo + 62, lo + 64, lo + 96], dtype=np.uint64)
    assert triton_bounds.outside(ptrs, np.ones(5, bool), 4, spans).tolist() == [lo + 62, lo + 64]
    assert triton_bounds.outside(ptrs, np.array([1, 1, 0, 0, 1], bool), 4, spans).tolist() == []


def test_our_product_launched_past_its_weight_is_caught(recorded):
    """few_rows' kernel told N = 33 outputs of a weight of 32 rows: the 33rd row's loads leave the weight (a view of
    40 rows' storage, so what lies past it is no other tensor of the launch)."""
    few_rows = pytest.importorskip("rlspec.rollout.runtime.model.few_rows")
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(40, 64).bfloat16()[:32]
    y = torch.empty(2, 33, dtype=torch.bfloat16)
    args = dict(HAS_BIAS=False, HAS_RES=False, HAS_NORM=False, GATED=False, BM=16, BN=16, BK=64, BF16=True, F32=True,
                PDL=False)
    for N, out in ((32, y[:, :32]), (33, y)):
        try:
            few_rows._few_rows[(1, triton.cdiv(N, 16))](x, w, y, y, y, out, 2, N, 64, 64, 64, 33, 33, 0.0, **args)
        except Exception:  # noqa: BLE001 - the interpreter wraps the check's IndexError
            pass
        recorded += triton_bounds.take()
        assert len(recorded) == (N == 33)
    assert recorded[0].startswith("a load of")
