"""`KVLayout`: the geometry of the KV a transfer moves, described once from the KV-cache spec.

Each attention layer's cache is `[num_parts, num_blocks, block_size, num_kv_heads, head_size]`
(shoal/layers/kv_cache_spec.py: keys and values per KV head, or MLA's one latent). A transfer of
n blocks holds, per layer, those n blocks in that shape, layers in order. Both sides compare
layouts before a byte is copied: a decode engine never reads KV of another model, dtype, block
size or tensor-parallel split. Plain Python (the dtype by name).
"""

from __future__ import annotations

import msgspec

from shoal.kv_transfer.params import KVTransferError


class LayerLayout(msgspec.Struct, array_like=True, frozen=True):
    """One layer's `KVCacheSpec`: `num_parts` tensors of `num_kv_heads x head_size` per token."""

    num_parts: int
    num_kv_heads: int
    head_size: int


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    layers: list[LayerLayout]
    block_size: int
    dtype: str  # torch's name: "float32", "bfloat16", ...
    element_size: int

    def block_shape(self, layer: int, num_blocks: int) -> tuple[int, int, int, int, int]:
        spec = self.layers[layer]
        return (spec.num_parts, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)

    def layer_block_bytes(self, layer: int) -> int:
        spec = self.layers[layer]
        return spec.num_parts * self.block_size * spec.num_kv_heads * spec.head_size * self.element_size

    def block_bytes(self) -> int:
        """Bytes one block takes over every layer."""
        return sum(self.layer_block_bytes(i) for i in range(len(self.layers)))

    def check_matches(self, other: KVLayout) -> None:
        if other != self:
            raise KVTransferError(f"KV layouts differ: the transfer holds {other}, this engine caches {self}")
