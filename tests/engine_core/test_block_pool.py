"""BlockPool: allocation order, reference counts, LRU eviction of free cached blocks."""

from __future__ import annotations

import pytest

from shoal.engine_core.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    """The free queue, next-to-be-reused first."""
    return list(pool._free)


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0 and pool.usage() == 0.0
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(3)
    assert ids(first) == [0, 1]
    assert ids(second) == [2, 3, 4]
    assert all(b.ref_cnt == 1 for b in first + second)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    assert pool.usage() == pytest.approx(5 / 6)


def test_get_new_blocks_over_capacity_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.get_new_blocks(1)) == [2]


def test_get_zero_blocks() -> None:
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.num_free_blocks == 2


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3]])
    assert free_order(pool) == [2, 0, 3]
    assert ids(pool.get_new_blocks(2)) == [2, 0]
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.num_free_blocks == 0


def test_shared_block_is_free_only_after_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2
    assert free_order(pool) == [1, 0]


def test_cached_free_block_can_be_touched_back_and_leaves_the_free_queue() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_block(a, b"h-a")
    pool.free_blocks([b, a])
    assert free_order(pool) == [1, 0]
    hit = pool.get_cached_block(b"h-a")
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and free_order(pool) == [1]
    assert a.block_hash == b"h-a"  # still cached while in use


def test_allocation_evicts_the_hash_of_a_reused_block() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    pool.free_blocks([b, a])  # b is freed first, so b is evicted first
    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert b.block_hash is None and pool.get_cached_block(b"h-b") is None
    assert pool.get_cached_block(b"h-a") is a


def test_cache_block_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None
    # A block that already has a hash is not registered under a second one.
    pool.cache_block(a, b"other")
    assert a.block_hash == b"same" and pool.get_cached_block(b"other") is None
    pool.cache_block(c, b"other")
    assert pool.get_cached_block(b"other") is c


def test_reset_prefix_cache_forgets_every_hash_but_keeps_blocks() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_block(a, b"h-a")
    pool.cache_block(b, b"h-b")
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h-a") is None and pool.get_cached_block(b"h-b") is None
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 1 and b.ref_cnt == 1
    # The freed block is still reusable, the held one still held.
    assert ids(pool.get_new_blocks(1)) == [0]
