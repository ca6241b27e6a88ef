"""KVCache compaction: move_rows (many rows, one indexed copy) equals row-by-row moves."""
import pytest
import torch

from rollout.runtime import kv_cache
from rollout.runtime.kv_cache import KVCache
from tests.conftest import make_tiny_hf


def _cache(rows=8, length=16):
    from rollout.runtime.model.config import ModelConfig

    cache = KVCache(ModelConfig.from_hf(make_tiny_hf("llama").config), rows, length, torch.float32, "cpu",
                    extra_layers=1)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    return cache


@pytest.mark.parametrize("src,dst", [([6, 7], [1, 3]),  # holes filled from the tail
                                     ([3, 5], [1, 3]),  # a destination is also a source: read before written
                                     ([2], [0])])
def test_move_rows_equals_row_by_row_moves(src, dst):
    a, b = _cache(), _cache()
    a.move_rows(src, dst, 10)
    k_before, v_before = b.k.clone(), b.v.clone()
    for s, d in zip(src, dst):  # the same moves one at a time, reading the original rows
        b.k[:, d, :, :10] = k_before[:, s, :, :10]
        b.v[:, d, :, :10] = v_before[:, s, :, :10]
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert torch.equal(a.k[:, dst[0], :, 10:], k_before[:, dst[0], :, 10:]), "positions past length untouched"


def test_move_rows_chunks_layers_when_the_copy_would_be_large(monkeypatch):
    a, b = _cache(), _cache()
    monkeypatch.setattr(kv_cache, "MOVE_CHUNK_BYTES", 1)  # one layer at a time
    a.move_rows([5, 6, 7], [0, 2, 4], 12)
    for s, d in zip([5, 6, 7], [0, 2, 4]):
        b.move(s, d, 12)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_move_rows_checks_its_arguments():
    cache = _cache()
    with pytest.raises(ValueError, match="as many sources"):
        cache.move_rows([1, 2], [0], 4)
    with pytest.raises(ValueError, match="distinct"):
        cache.move_rows([1, 2], [0, 0], 4)
    before = cache.k.clone()
    cache.move_rows([], [], 4)
    cache.move_rows([3], [1], 0)
    assert torch.equal(cache.k, before)
