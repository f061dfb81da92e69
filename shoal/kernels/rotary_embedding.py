"""Rotary position embedding (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding"), applied in place with the semantics of the CUDA op `rotary_embedding`.

`cos_sin_cache[p]` is `[cos(p * inv_freq), sin(p * inv_freq)]`, `rotary_dim` values in all; the
first `rotary_dim` features of every head are rotated and the rest are left alone. Neox style
pairs feature i with feature i + rotary_dim / 2 (Hugging Face's `rotate_half`); GPT-J style pairs
neighbours 2i and 2i + 1.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    """Rotate x [num_tokens, num_heads, rotary_dim] in place; cos, sin [num_tokens, 1, rotary_dim / 2]."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)  # halves: [num_tokens, num_heads, rotary_dim / 2] each
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    # Written like HF's `x * cos + rotate_half(x) * sin` so float32 results agree bit for bit.
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if is_neox:
        x.copy_(torch.cat((out1, out2), dim=-1))
    else:
        x.copy_(torch.stack((out1, out2), dim=-1).flatten(-2))  # re-interleave: [..., rotary_dim]


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate query [num_tokens, num_heads * head_size] and key [num_tokens, num_kv_heads * head_size]."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache.index_select(0, positions.to(torch.int64)).to(query.dtype)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim / 2] each
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)  # [num_tokens, num_heads, head_size]
        _rotate(heads[..., :rotary_dim], cos, sin, is_neox)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    op = compiled_op("rotary_embedding", query)
    if op is None:
        rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox)
    else:
        op(positions, query, key, head_size, cos_sin_cache, is_neox)
