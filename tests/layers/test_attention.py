from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.forward_context import set_forward_context
from shoal.layers.attention import Attention
from tests.kernels.metadata_utils import allocate_block_tables, make_attention_metadata


def _causal(q, k, v, scale):
    """q [T, nh, hd], k, v [T, nkv, hd] -> [T, nh * hd]."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def test_prefill_then_decode_through_the_cache():
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    layer = Attention(num_heads, head_dim, 0.3, num_kv_heads)
    layer.kv_cache = torch.zeros(2, 8, block_size, num_kv_heads, head_dim)
    tables = allocate_block_tables([7], block_size, 8)
    q = torch.randn(7, num_heads, head_dim)
    k, v = torch.randn(7, num_kv_heads, head_dim), torch.randn(7, num_kv_heads, head_dim)
    expected = _causal(q, k, v, 0.3)
    with set_forward_context(make_attention_metadata([6], [6], tables, block_size)):
        prefill = layer(q[:6].reshape(6, -1), k[:6].reshape(6, -1), v[:6].reshape(6, -1))
    with set_forward_context(make_attention_metadata([1], [7], tables, block_size)):
        decode = layer(q[6:].reshape(1, -1), k[6:].reshape(1, -1), v[6:].reshape(1, -1))
    torch.testing.assert_close(torch.cat((prefill, decode)), expected)


def test_without_metadata_is_one_causal_sequence():
    layer = Attention(2, 8, 0.5, 1)
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    with set_forward_context(None):
        out = layer(q.reshape(5, -1), k.reshape(5, -1), v.reshape(5, -1))
    torch.testing.assert_close(out, _causal(q, k, v, 0.5))


def test_metadata_without_cache_fails_clearly():
    layer = Attention(2, 8, 0.5)
    md = make_attention_metadata([1], [1], [[0]], 4)
    with set_forward_context(md), pytest.raises(RuntimeError, match="no KV cache"):
        layer(torch.randn(1, 16), torch.randn(1, 16), torch.randn(1, 16))
