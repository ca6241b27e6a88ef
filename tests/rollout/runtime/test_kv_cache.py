"""PagedKVCache: addressing through the block table, the allocator's decisions mirrored into it,
prompt sharing with copy-on-write, compaction of table rows, tree fix-ups across blocks."""
import pytest
import torch

from rlspec.rollout.runtime.kv_cache import PagedKVCache
from rlspec.rollout.runtime.model.config import ModelConfig
from tests.conftest import make_tiny_hf

BS = 4


def _cache(rows=4, length=16, blocks=20):
    cache = PagedKVCache(ModelConfig.from_hf(make_tiny_hf("llama").config), rows, length, blocks, BS, torch.float32,
                         "cpu", extra_layers=1)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def test_slots_follow_the_table_and_send_the_rest_to_trash():
    cache = _cache()
    cache.grow([(1, "a", 6)])  # two blocks: positions 0..7
    held = cache.alloc.held("a")
    assert cache.table[1, :2].tolist() == held and cache.table[1, 2:].eq(0).all()
    pos = torch.tensor([[0, 5, 7, 8, -1, 16]])
    got = cache.slots(torch.tensor([1]), pos)[0].tolist()
    assert got[:3] == [held[0] * BS, held[1] * BS + 1, held[1] * BS + 3]
    assert got[3:] == [0, 0, 0], "unassigned block, negative and past-the-table positions: the trash block"


def test_host_slots_are_the_tables_slots():
    """host_slots (a drafter's slots from the allocator's lists, on the host) gives what slots() reads from the table,
    for held, shared, unassigned, negative and past-the-table positions, after sharing and moving rows."""
    cache = _cache()
    cache.grow([(0, "head", 11)])
    cache.share_prompt(0, "head", [(1, "s1"), (2, "s2")], prompt_len=10)
    cache.grow([(1, "s1", 14)])  # s1 grows past the shared prompt
    cache.move_rows([2], [3])  # s2 now sits in row 3
    pos = [0, 3, 7, 9, 10, 13, 15, -1, 16, 17]
    for row, owner in ((0, "head"), (1, "s1"), (3, "s2")):
        want = cache.slots(torch.tensor([row]), torch.tensor([pos]))[0].tolist()
        assert cache.host_slots(owner, pos) == want, owner


def test_write_then_gather_round_trips_positions():
    cache = _cache()
    cache.grow([(0, "a", 10), (2, "b", 3)])
    x = torch.randn(2, 3, cache.k.shape[3], cache.k.shape[4])
    pos = torch.tensor([[0, 4, 9], [0, 1, 2]])
    rows = torch.tensor([0, 2])
    cache.write(1, cache.slots(rows, pos), x, -x)
    k, v = cache.gather(1, rows, 10)  # [2, KV, 12, D]
    assert k.shape[2] == 12
    assert torch.equal(k[0, :, 4], x[0, 1]) and torch.equal(k[0, :, 9], x[0, 2]) and torch.equal(v[1, :, 2], -x[1, 2])


def test_trim_hands_back_blocks_and_clears_their_entries():
    cache = _cache()
    cache.grow([(0, "a", 13)])  # 4 blocks
    free = cache.alloc.free
    cache.trim([(0, "a", 5)])  # keep 2
    assert cache.alloc.free == free + 2 and cache.table[0, 2:].eq(0).all() and cache.table[0, :2].ne(0).all()


def test_share_prompt_references_full_blocks_and_copies_the_last_one():
    cache = _cache()
    cache.grow([(0, "head", 11)])  # a 10-token prompt + the pending position: 3 blocks
    head = cache.alloc.held("head")
    cache.share_prompt(0, "head", [(1, "s1"), (2, "s2")], prompt_len=10)
    for row, owner in ((1, "s1"), (2, "s2")):
        held = cache.alloc.held(owner)
        assert held[:2] == head[:2], "positions 0..7 lie below the last prompt token: shared"
        assert held[2] != head[2], "the block of the last prompt token is each sample's own"
        assert torch.equal(cache.k[:, held[2]], cache.k[:, head[2]]), "... a copy of the head's"
        assert cache.table[row, :3].tolist() == held
    assert [cache.alloc.refs[b] for b in head] == [3, 3, 1]
    assert cache.alloc.stats.shared_refs == 4
    cache.release("head")
    cache.release("s1")
    assert cache.alloc.refs[head[0]] == 1, "s2 still holds the shared blocks"
    cache.release("s2")
    assert cache.alloc.used == 0


def test_move_rows_moves_table_rows_and_clear_rows_points_at_trash():
    cache = _cache()
    cache.grow([(2, "a", 5), (3, "b", 9)])
    a, b = cache.table[2].clone(), cache.table[3].clone()
    cache.move_rows([3, 2], [0, 1])
    assert torch.equal(cache.table[0], b) and torch.equal(cache.table[1], a)
    cache.clear_rows(2)
    assert cache.table[2:].eq(0).all()


def test_gather_positions_moves_every_layer_across_blocks():
    cache = _cache()
    cache.grow([(1, "a", 12)])
    k0, _ = cache.gather(0, torch.tensor([1]), 12)
    kd, _ = cache.gather(2, torch.tensor([1]), 12)  # the drafter's layer moves too
    cache.gather_positions(1, [9, 6], [5, 6])
    k1, _ = cache.gather(0, torch.tensor([1]), 12)
    kd1, _ = cache.gather(2, torch.tensor([1]), 12)
    assert torch.equal(k1[0, :, 5], k0[0, :, 9]) and torch.equal(k1[0, :, 6], k0[0, :, 6])
    assert torch.equal(kd1[0, :, 5], kd[0, :, 9])
    assert torch.equal(k1[0, :, :5], k0[0, :, :5])


def test_for_rows_is_the_contiguous_equivalent():
    cfg = ModelConfig.from_hf(make_tiny_hf("llama").config)
    cache = PagedKVCache.for_rows(cfg, 3, 10, torch.float32, "cpu", block_size=4)
    assert cache.alloc.free == 0 and cache.table.ne(0).all() and cache.length == 12


def test_budget_too_small_for_one_sequence_names_the_size():
    from rlspec.rollout.runtime.kv_budget import KVBudget

    with pytest.raises(ValueError, match=r"one sequence of 1000 positions needs 63 blocks = .* GiB"):
        KVBudget(memory_gb=1e-6).pool_blocks(1024, rows=4, length=1024, min_positions=1000, device="cpu")
    assert KVBudget(memory_gb=1.0).pool_blocks(1024, rows=4, length=64, min_positions=64, device="cpu") == 17
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        KVBudget(memory_fraction=1.5)


def test_step_slots_are_slots_inside_the_table():
    """kv_cache.step_slots (a step's positions, all inside the table) gives slots()'s answer without its guards."""
    cache = _cache(rows=4, length=32, blocks=40)
    g = torch.Generator().manual_seed(0)
    cache.table[:3] = torch.randint(1, 40, (3, cache.table.shape[1]), generator=g)  # row 3: the trash block's
    positions = torch.randint(0, 32, (4, 5), generator=g)
    assert torch.equal(cache.step_slots(positions), cache.slots(torch.arange(4), positions))
