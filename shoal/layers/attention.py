"""Multi-head attention over the paged KV cache (Vaswani et al., 2017, "Attention Is All You
Need"; Kwon et al., 2023, "PagedAttention"), one layer's worth, with per-rank head counts.

The model runner binds `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_dim] to each
layer after allocating the cache; the batch's layout comes from the forward context.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shoal.forward_context import AttentionMetadata, get_forward_context
from shoal.kernels.paged_attention import paged_attention
from shoal.kernels.reshape_and_cache import reshape_and_cache
from shoal.layers.kv_cache_spec import KVCacheSpec, full_attention_spec

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    """softmax(q k^T * scale) v for this rank's `num_heads` query heads, which share
    `num_kv_heads` key/value heads in groups of num_heads / num_kv_heads (GQA)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"{num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly")
        # A plain attribute, not a buffer: the runner owns the cache and binds it here.
        self.kv_cache: torch.Tensor | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """A key and a value per KV head and token."""
        return full_attention_spec(self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cached: bool = False) -> torch.Tensor:
        """q [num_tokens, num_heads * head_dim], k and v [num_tokens, num_kv_heads * head_dim]
        -> [num_tokens, num_heads * head_dim]. `kv_cached`: the caller already wrote k and v to
        the cache (shoal/kernels/rope_and_cache.py fuses that write with the rotary embedding)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None:
            out = self._forward_without_cache(q, k, v)
        else:
            if self.kv_cache is None:
                raise RuntimeError("attention ran with metadata but no KV cache bound to the layer")
            if not kv_cached:
                reshape_and_cache(k, v, self.kv_cache, attn_metadata.slot_mapping)
            out = self.attend(q, k, v, attn_metadata)
        return out.view(num_tokens, self.num_heads * self.head_dim)  # [num_tokens, num_heads * head_dim]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] over the cache (holding this step's k and v) ->
        [num_tokens, num_heads, head_dim]. k and v too: fresh prompts can attend over them
        directly instead of the cache. (batch_invariant=True replaces it: shoal/layers/batch_invariant.py.)"""
        assert self.kv_cache is not None
        return paged_attention(q, self.kv_cache, attn_metadata, self.scale, key=k, value=v)

    def _forward_without_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """No metadata (a profiling or warm-up run): the whole batch as one causal sequence."""
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [num_(kv_)heads, num_tokens, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1).contiguous()  # [num_tokens, num_heads, head_dim]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
