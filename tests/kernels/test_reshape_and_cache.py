from __future__ import annotations

import pytest
import torch

from shoal.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from tests.kernels.csrc_utils import DTYPES as CSRC_DTYPES
from tests.kernels.csrc_utils import csrc_op


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


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 8), (8, 128), (3, 20)])  # 3 x 20: not whole packs
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_reshape_and_cache_csrc_matches_reference(block_size, num_kv_heads, head_size, dtype):
    num_blocks, num_tokens = 64, 37
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device="cuda")
    expected = kv_cache.clone()
    # key and value as views into a fused qkv projection, as the attention layer passes them.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_size, dtype=dtype, device="cuda")
    width = num_kv_heads * head_size
    key = qkv[:, 2 * width : 3 * width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 3 * width :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::5] = -1  # padding
    csrc_op("reshape_and_cache")(key, value, kv_cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(kv_cache, expected)
