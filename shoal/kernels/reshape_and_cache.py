"""Write this step's keys and values into the paged KV cache (Kwon et al., 2023, "Efficient
Memory Management for Large Language Model Serving with PagedAttention"), with the semantics of
the CUDA op `reshape_and_cache`.

Layout: `kv_cache[0]` holds keys and `kv_cache[1]` values, each `[num_blocks, block_size,
num_kv_heads, head_size]`; token t goes to block `slot_mapping[t] // block_size`, offset
`slot_mapping[t] % block_size`. A slot of -1 (padding) is not written.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value [num_tokens, num_kv_heads, head_size]; kv_cache [2, num_blocks, block_size, ...]."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    # A block table indexes blocks; a slot indexes (block, offset) pairs, i.e. rows of this view.
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)  # [num_slots, num_kv_heads, head_size]
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)  # [num_slots, num_kv_heads, head_size]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    key_cache.index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.index_copy_(0, slots, value.to(value_cache.dtype))


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    op = compiled_op("reshape_and_cache", key)
    if op is None:
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
    else:
        op(key, value, kv_cache, slot_mapping)
