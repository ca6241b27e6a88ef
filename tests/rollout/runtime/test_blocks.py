"""BlockAllocator: free list, reference counts, growth, trimming, sharing, and its accounting."""
import pytest

from rlspec.rollout.runtime.blocks import TRASH, BlockAllocator, OutOfBlocks


def test_ensure_grows_by_whole_blocks_and_never_hands_out_trash():
    a = BlockAllocator(num_blocks=6, block_size=4)
    assert a.capacity == 5 and a.free == 5
    new = a.ensure("s", 5)  # positions 0..4: two blocks
    assert [i for i, _ in new] == [0, 1] and TRASH not in a.held("s")
    assert a.ensure("s", 8) == [] and a.needed("s", 9) == 1
    assert a.used == 2 and a.stats.peak_used == 2


def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.ensure("x", 4)
    with pytest.raises(OutOfBlocks):
        a.ensure("y", 6)
    assert a.held("y") == [] and a.free == 1


def test_trim_frees_blocks_past_the_kept_positions_and_reuses_them_first():
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.ensure("s", 16)
    last = a.held("s")[-1]
    assert a.trim("s", 9) == [3] and len(a.held("s")) == 3
    assert a.ensure("t", 1) == [(0, last)], "a block freed a moment ago is handed out next (warm)"
    assert a.trim("s", 12) == []


def test_shared_blocks_are_freed_by_their_last_holder():
    a = BlockAllocator(num_blocks=10, block_size=4)
    a.ensure("head", 11)
    head = a.held("head")
    a.share("head", "sib", 2)
    assert a.held("sib") == head[:2] and [a.refs[b] for b in head] == [2, 2, 1]
    a.ensure("sib", 11)
    assert a.held("sib")[2] not in head and a.stats.shared_refs == 2
    assert a.free_owner("head") == 3
    assert a.refs[head[0]] == 1 and a.free == 9 - 4 + 1, "only the unshared block came back"
    a.free_owner("sib")
    assert a.used == 0 and all(r == 0 for r in a.refs)
    with pytest.raises(ValueError, match="already holds"):
        a.ensure("x", 1)
        a.share("head", "x", 0)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)
    with pytest.raises(ValueError, match="trash block"):
        BlockAllocator(1, 16)
