from __future__ import annotations

import pytest
import torch

from shoal.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 8), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_each_slot(block_size, num_kv_heads, head_size, dtype):
    num_blocks, num_tokens = 16, 11
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1  # padding: not written
    reshape_and_cache_ref(key, value, kv_cache, slots)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        block, offset = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, block, offset], key[t])
        assert torch.equal(kv_cache[1, block, offset], value[t])
    untouched = kv_cache.view(2, -1, num_kv_heads, head_size)[:, ~written]
    assert torch.count_nonzero(untouched) == 0


def test_reshape_and_cache_accepts_strided_inputs():
    """k and v arrive as views into the fused qkv projection."""
    qkv = torch.randn(5, 3 * 2 * 4)
    key = qkv[:, 8:16].view(5, 2, 4)
    value = qkv[:, 16:].view(5, 2, 4)
    kv_cache = torch.zeros(2, 2, 4, 2, 4)
    reshape_and_cache(key, value, kv_cache, torch.arange(5))
    assert torch.equal(kv_cache[0].reshape(-1, 2, 4)[:5], key)
    assert torch.equal(kv_cache[1].reshape(-1, 2, 4)[:5], value)
