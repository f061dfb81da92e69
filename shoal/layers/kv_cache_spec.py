"""What one attention layer keeps per token in the paged KV cache, declared by the layer.

The scheduler counts blocks of `block_size` tokens and never needs to know what a block holds;
the worker sizes and allocates the cache from the layers' specs:

- standard (grouped-query) attention: a key and a value per KV head, `[2, num_blocks,
  block_size, num_kv_heads, head_size]` (index 0 keys, 1 values);
- multi-head latent attention (DeepSeek-V2/V3): one compressed latent per token, shared by every
  head, `[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`.

Both keep the same five dimensions, so code that only moves caches around (sleep, restarts)
treats them alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """`num_parts` tensors of `num_kv_heads x head_size` values per token."""

    num_parts: int
    num_kv_heads: int
    head_size: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """The cache tensor's shape: [num_parts, num_blocks, block_size, num_kv_heads, head_size]."""
        return (self.num_parts, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def values_per_token(self) -> int:
        return self.num_parts * self.num_kv_heads * self.head_size

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of `block_size` tokens takes in this layer's cache."""
        return block_size * self.values_per_token() * torch.empty((), dtype=dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape(num_blocks, block_size), dtype=dtype, device=device)


def full_attention_spec(num_kv_heads: int, head_size: int) -> KVCacheSpec:
    """Keys and values of `num_kv_heads` heads."""
    return KVCacheSpec(num_parts=2, num_kv_heads=num_kv_heads, head_size=head_size)


def mla_spec(kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
    """The latent of multi-head latent attention: the normalized `kv_lora_rank` values, then the
    `qk_rope_head_dim` rotated key values, one "head" for all query heads."""
    return KVCacheSpec(num_parts=1, num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim)
