"""The host-memory tier: blocks the device prefix cache evicts are kept on the host and loaded
back on a later hit (shoal/kv_transfer/host_tier.py, host_pool.py)."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from shoal.engine_core.block_pool import BlockPool
from shoal.engine_core.request import Request
from shoal.kv_transfer.host_tier import HostKVTier

BLOCK_SIZE = 4


def _prompts(num: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j + 11) % 200 + 5 for j in range(length)] for i in range(num)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prompts_that_evict_each_other_come_back_from_the_host(tiny_checkpoints: dict, device: str) -> None:
    """Three 40-token prompts in a 16-block device cache: each evicts the one before. Repeated,
    their prefixes are loaded from the host tier (on GPU: pinned, on a side stream), not
    recomputed, and the outputs are those of an engine without any cache."""
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, 40)]
    llm = LLM(
        path,
        device=device,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=16,
        max_model_len=64,
        kv_offload_bytes=1 << 20,
    )
    first = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    before = llm.get_stats()
    assert before["kv_offload_blocks_offloaded"] >= 9 and before["kv_offload_host_hit_tokens"] == 0
    again = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    after = llm.get_stats()
    # Nine full blocks of each 40-token prompt (the tenth holds its last token, always computed).
    assert after["kv_offload_host_hit_tokens"] - before["kv_offload_host_hit_tokens"] >= 2 * 36
    assert after["kv_offload_blocks_loaded"] - before["kv_offload_blocks_loaded"] >= 2 * 9
    assert all(o.num_cached_tokens >= 36 for o in again[:2])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    fresh = LLM(path, device=device, block_size=BLOCK_SIZE, enable_prefix_caching=False, max_model_len=64)
    expected = fresh.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in expected]
    assert after["num_used_blocks"] == 0


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(),
        eos_token_id=None,
        max_tokens=4,
    )


def test_the_tier_keeps_evicted_hashes_lru_and_pins_what_it_promised() -> None:
    pool = BlockPool(4)
    tier = HostKVTier(num_host_blocks=2, block_size=BLOCK_SIZE, block_pool=pool)
    blocks = pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, (b"a", b"b", b"c")):
        pool.cache_block(block, block_hash)
    pool.free_blocks(blocks)
    pool.get_new_blocks(4)  # evicts a, b, c: the host keeps the two most recent
    copies = tier.take_block_copies()
    assert copies is not None and copies.offload_block_ids == [0, 1, 2]
    assert tier.stats.blocks_offloaded == 3 and tier.stats.blocks_dropped == 1
    request = _request("r", list(range(13)))
    request.block_hashes.extend([b"b", b"c", b"x"])
    assert tier.num_loadable_tokens(request, 0) == 2 * BLOCK_SIZE
    tier.load_into(request, [3, 2, 1, 0], 0, 2 * BLOCK_SIZE)
    copies = tier.take_block_copies()
    assert copies is not None and copies.load_block_ids == [3, 2] and not copies.offload_block_ids
    pool.reset_prefix_cache()
    assert tier.num_cached_blocks == 0 and tier.num_loadable_tokens(request, 0) == 0


def test_kv_offload_bytes_needs_prefix_caching(tiny_checkpoints: dict) -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(tiny_checkpoints["llama"]), enable_prefix_caching=False, kv_offload_bytes=1 << 20, max_model_len=64)
