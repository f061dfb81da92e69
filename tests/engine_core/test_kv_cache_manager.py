"""KVCacheManager: exact block ids, hash-chained prefix hits, eviction order, refcounts."""

from __future__ import annotations

import pytest

from shoal.engine_core.kv_cache_manager import KVCacheManager, hash_block_tokens
from shoal.engine_core.request import Request
from shoal.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=None, max_tokens=16)


def admit(kv: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: look up its prefix, allocate the rest."""
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = kv.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return new_blocks, num_hit_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_hash_covers_parent_and_tokens() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(root) == 16
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    assert child != hash_block_tokens(None, [5, 6, 7, 8])
    assert child != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert child == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_fresh_allocation_takes_ids_in_order_and_caches_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    new_blocks, num_hit = admit(kv, a)
    assert num_hit == 0
    assert ids(new_blocks) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    # Two full blocks are registered under the request's hash chain; the partial third is not.
    assert len(a.block_hashes) == 2
    assert a.block_hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], [4, 5, 6, 7])
    pool = kv.block_pool
    assert ids([pool.get_cached_block(h) for h in a.block_hashes]) == [0, 1]
    assert pool.blocks[2].block_hash is None
    b = make_request("b", [100] * 3)
    assert ids(admit(kv, b)[0]) == [3]


def test_chunked_allocation_grows_the_block_table_and_caches_as_blocks_fill() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(11)))
    assert ids(kv.allocate_slots(a, 5)) == [0, 1]
    a.num_computed_tokens = 5
    assert kv.num_cached_blocks["a"] == 1
    assert kv.block_pool.get_cached_block(a.block_hashes[0]).block_id == 0
    assert ids(kv.allocate_slots(a, 2)) == []  # 7 tokens still fit in two blocks
    a.num_computed_tokens = 7
    assert kv.block_pool.blocks[1].block_hash is None
    assert ids(kv.allocate_slots(a, 4)) == [2]
    a.num_computed_tokens = 11
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_cached_blocks["a"] == 2
    assert kv.block_pool.blocks[1].block_hash == a.block_hashes[1]


def test_block_filled_by_an_output_token_is_cached_with_it() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    admit(kv, a)
    assert kv.block_pool.blocks[1].block_hash is None
    a.append_output_token_id(42)
    assert ids(kv.allocate_slots(a, 1)) == []
    assert kv.block_pool.blocks[1].block_hash == hash_block_tokens(a.block_hashes[0], [5, 6, 7, 42])


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    a = make_request("a", [*prefix, 50, 51])
    b = make_request("b", [*prefix, 60, 61, 62, 63, 64])
    admit(kv, a)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert ids(hit_blocks) == [0, 1] and num_hit == 8
    new_blocks, _ = admit(kv, b)
    assert ids(new_blocks) == [3, 4]
    assert kv.get_block_ids("b") == [0, 1, 3, 4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 1, 1]
    kv.free(a)
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(5)] == [1, 1, 0, 1, 1]
    assert kv.num_free_blocks == 4
    kv.free(b)
    assert kv.num_free_blocks == 8
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def test_same_tokens_after_a_different_prefix_do_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 1 holds the same tokens as a's block 1, but after another first block.
    other = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(other) == ([], 0)
    # A hit stops at the first block that differs, even if later blocks match a's.
    partial = make_request("c", [1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8, 9])
    hit_blocks, num_hit = kv.get_computed_blocks(partial)
    assert ids(hit_blocks) == [0] and num_hit == 4


def test_last_prompt_token_is_always_recomputed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(8))))
    # An identical prompt hits only its first block: the last token must run through the model.
    same = make_request("b", list(range(8)))
    hit_blocks, num_hit = kv.get_computed_blocks(same)
    assert ids(hit_blocks) == [0] and num_hit == 4
    # One more token and both full blocks can be reused.
    longer = make_request("c", [*range(8), 99])
    hit_blocks, num_hit = kv.get_computed_blocks(longer)
    assert ids(hit_blocks) == [0, 1] and num_hit == 8
    # A prompt shorter than a block never hits.
    assert kv.get_computed_blocks(make_request("d", [0, 1, 2, 3])) == ([], 0)


def test_prefix_cache_counters_count_each_admission_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(10))))
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (10, 0)
    admit(kv, make_request("b", [*range(8), 7, 7, 7]))
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (21, 8)
    # A lookup whose allocation fails is retried later; it must not be counted on every retry.
    big = make_request("big", [*range(8), *range(100, 130)])
    assert admit(kv, big)[0] is None
    assert admit(kv, big)[0] is None
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (21, 8)


def test_free_evicts_the_tail_blocks_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(13)))
    admit(kv, a)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.free(a)
    assert list(kv.block_pool._free) == [4, 5, 6, 7, 3, 2, 1, 0]
    filler = make_request("filler", [500] * 21)
    assert ids(admit(kv, filler)[0]) == [4, 5, 6, 7, 3, 2]
    # Blocks 0 and 1 (the head of a's prefix) survived the eviction of 2 and 3.
    again = make_request("again", list(range(13)))
    hit_blocks, num_hit = kv.get_computed_blocks(again)
    assert ids(hit_blocks) == [0, 1] and num_hit == 8


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", [1] * 5)
    b = make_request("b", [2] * 5)
    admit(kv, a)
    admit(kv, b)
    assert kv.get_block_ids("a") == [0, 1] and kv.get_block_ids("b") == [2, 3]
    kv.free(a)
    kv.free(b)
    assert list(kv.block_pool._free) == [1, 0, 3, 2]
    # Two new blocks evict a's (freed first); b's cached block 2 survives.
    admit(kv, make_request("c", [3] * 7))
    assert kv.get_block_ids("c") == [1, 0]
    assert kv.get_computed_blocks(make_request("a2", [1] * 5)) == ([], 0)
    hit_blocks, num_hit = kv.get_computed_blocks(make_request("b2", [2] * 5))
    assert ids(hit_blocks) == [2] and num_hit == 4


def test_hit_on_a_free_cached_block_moves_it_out_of_the_lru_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", [1] * 5)
    admit(kv, a)
    kv.free(a)
    assert list(kv.block_pool._free) == [2, 3, 1, 0]
    b = make_request("b", [1] * 6)
    new_blocks, num_hit = admit(kv, b)
    assert num_hit == 4 and ids(new_blocks) == [2]
    assert kv.get_block_ids("b") == [0, 2]
    assert list(kv.block_pool._free) == [3, 1]
    assert kv.block_pool.blocks[0].ref_cnt == 1


def test_failed_allocation_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    admit(kv, a)
    b = make_request("b", [7] * 6)
    assert admit(kv, b)[0] is None
    assert "b" not in kv.req_to_blocks and kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1
    assert b.num_computed_tokens == 0
    # A running request that cannot grow keeps exactly what it had.
    a.append_output_token_id(1)
    assert ids(kv.allocate_slots(a, 1)) == [3]
    a.num_computed_tokens = 13
    for token in range(3):
        a.append_output_token_id(token)
    a.num_computed_tokens = 16
    a.append_output_token_id(5)
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert [b.ref_cnt for b in kv.block_pool.blocks] == [1, 1, 1, 1]


def test_hits_on_free_cached_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    a = make_request("a", [*prefix, 9])
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    # 17 tokens need 5 blocks: 2 hits (both free) + 3 new, but taking the hits leaves only 2.
    too_big = make_request("too_big", [*prefix, *range(100, 109)])
    hit_blocks, num_hit = kv.get_computed_blocks(too_big)
    assert ids(hit_blocks) == [0, 1] and num_hit == 8
    assert kv.allocate_slots(too_big, 9, hit_blocks, num_hit) is None
    assert kv.num_free_blocks == 4
    assert [b.ref_cnt for b in kv.block_pool.blocks] == [0, 0, 0, 0]
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is kv.block_pool.blocks[0]
    # 16 tokens need 4 blocks: 2 hits + 2 new fits exactly.
    fits = make_request("fits", [*prefix, *range(100, 108)])
    new_blocks, num_hit = admit(kv, fits)
    assert num_hit == 8 and ids(new_blocks) == [3, 2]  # the free queue was [3, 2, (1, 0)]
    assert kv.get_block_ids("fits") == [0, 1, 3, 2] and kv.num_free_blocks == 0


def test_reset_prefix_cache_drops_hits_and_never_registers_stale_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(6)))  # one full block cached, one partial
    short = make_request("short", [50, 51, 52])  # no full block yet
    admit(kv, a)
    admit(kv, short)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("x", list(range(9)))) == ([], 0)
    # The blocks held across the reset were computed with the old weights: when they fill up,
    # they must not be offered to other requests.
    for request in (a, short):
        request.append_output_token_id(1)
        request.append_output_token_id(2)
        kv.allocate_slots(request, 2)
        request.num_computed_tokens += 2
    assert all(block.block_hash is None for block in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_request("y", [*range(6), 1, 2, 3])) == ([], 0)
    assert kv.get_computed_blocks(make_request("z", [50, 51, 52, 1, 2])) == ([], 0)
    # Blocks computed after the reset are cached again.
    fresh = make_request("fresh", list(range(20, 29)))
    admit(kv, fresh)
    hit_blocks, num_hit = kv.get_computed_blocks(make_request("w", list(range(20, 29))))
    assert num_hit == 8 and ids(hit_blocks) == kv.get_block_ids("fresh")[:2]


def test_no_prefix_caching_when_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert all(block.block_hash is None for block in kv.block_pool.blocks)
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (0, 0)


def test_prompt_logprobs_requests_skip_the_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(9))))
    wants_logprobs = make_request("b", list(range(9)), prompt_logprobs=2)
    assert kv.get_computed_blocks(wants_logprobs) == ([], 0)
    new_blocks, _ = admit(kv, wants_logprobs)
    assert ids(new_blocks) == [3, 4, 5]


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 8, 9])
def test_block_count_is_ceil_of_tokens(num_tokens: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(num_tokens))))
    assert len(kv.get_block_ids("a")) == -(-num_tokens // BLOCK_SIZE)
