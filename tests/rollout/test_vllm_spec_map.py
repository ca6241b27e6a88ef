"""SpecConfig -> vLLM speculative_config and the long-tail depth table (rollout/vllm_backend/spec_map.py).

Plain Python: runs in the main environment, without vLLM.
"""
from __future__ import annotations

import pytest

from rlspec.rollout.types import SpecConfig
from rlspec.rollout.vllm_backend.spec_map import DepthTable, UnsupportedSpec, depth_table, speculative_config


def test_depth_table_follows_buckets_and_merges_equal_depths():
    # a cost model that pays for depth 4 up to batch 2, depth 2 up to 8, nothing above
    table = depth_table(lambda b: 4 if b <= 2 else 2 if b <= 8 else 0, max_batch=48)
    assert table.ranges == ((1, 2, 4), (3, 8, 2), (9, 48, 0))
    assert [table.depth(b) for b in (1, 2, 3, 8, 9, 48)] == [4, 4, 2, 2, 0, 0]
    assert table.max_depth == 4


def test_depth_table_honours_max_spec_batch():
    table = depth_table(lambda b: 3, max_batch=16, max_spec_batch=4)
    assert table.ranges == ((1, 4, 3), (5, 16, 0))


def test_mapping_of_each_method():
    table = DepthTable(((1, 4, 3), (5, 64, 0)))
    cfg = speculative_config(SpecConfig(drafter="eagle3", num_draft_tokens=5), "/d", table)
    assert cfg == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/d", "draft_sample_method": "probabilistic",
                   "num_speculative_tokens_per_batch_size": [(1, 4, 3), (5, 64, 0)]}
    ngram = speculative_config(SpecConfig(drafter="ngram", num_draft_tokens=4, selector="always"))
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 4
    assert "num_speculative_tokens_per_batch_size" not in ngram
    assert speculative_config(SpecConfig(drafter="suffix", selector="always"))["method"] == "suffix"
    assert speculative_config(SpecConfig()) is None
    # costs that never pay: no speculation at all rather than a table of zeros
    assert speculative_config(SpecConfig(drafter="ngram"), None, DepthTable(((1, 64, 0),))) is None


@pytest.mark.parametrize("spec, match", [
    (SpecConfig(drafter="auto"), "drafter: auto"),
    (SpecConfig(drafter="ngram", tree_width=2), "tree_width"),
    (SpecConfig(drafter="ngram", selector="adaptive"), "selector: adaptive"),
])
def test_unsupported_combinations_say_what_to_change(spec, match):
    with pytest.raises(UnsupportedSpec, match=match):
        speculative_config(spec)


def test_eagle3_needs_a_drafter_directory():
    with pytest.raises(UnsupportedSpec, match="exported drafter directory"):
        speculative_config(SpecConfig(drafter="eagle3", selector="always"))


def test_the_backend_is_registered_and_says_how_to_get_vllm():
    import importlib.util

    from rlspec.rollout.backend import BACKENDS, build_backend

    assert "vllm" in BACKENDS
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="make vllm-venv"):
            build_backend("vllm", None, None, None)
