from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shoal.kernels.rotary_embedding import rotary_embedding, rotary_embedding_ref
from tests.kernels.csrc_utils import DTYPES as CSRC_DTYPES
from tests.kernels.csrc_utils import csrc_op, tolerance


def _cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inputs(num_tokens, num_heads, num_kv_heads, head_size, dtype):
    positions = torch.randint(0, 100, (num_tokens,))
    query = torch.randn(num_tokens, num_heads * head_size, dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads * head_size, dtype=dtype)
    return positions, query, key


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_size", [(1, 2, 1, 8), (9, 4, 2, 64), (17, 6, 6, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neox_matches_hf_rotate_half(num_tokens, num_heads, num_kv_heads, head_size, dtype):
    positions, query, key = _inputs(num_tokens, num_heads, num_kv_heads, head_size, dtype)
    cache = _cos_sin_cache(128, head_size).to(dtype)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [T, head_size] layout
    q_hf, k_hf = apply_rotary_pos_emb(
        query.view(num_tokens, num_heads, head_size), key.view(num_tokens, num_kv_heads, head_size), cos, sin
    )
    rotary_embedding_ref(positions, query, key, head_size, cache, is_neox=True)
    assert torch.equal(query.view_as(q_hf), q_hf)
    assert torch.equal(key.view_as(k_hf), k_hf)


@pytest.mark.parametrize("head_size,rotary_dim", [(16, 16), (64, 32)])
def test_gptj_is_complex_multiplication(head_size, rotary_dim):
    positions, query, key = _inputs(5, 3, 1, head_size, torch.float64)
    cache = _cos_sin_cache(128, rotary_dim).double()
    cos, sin = cache[positions].chunk(2, dim=-1)
    rotation = torch.complex(cos, sin)[:, None, :]  # [T, 1, rotary_dim / 2]
    expected = []
    for x, heads in ((query, 3), (key, 1)):
        x = x.view(5, heads, head_size).clone()
        pairs = torch.view_as_complex(x[..., :rotary_dim].reshape(5, heads, -1, 2).contiguous())
        x[..., :rotary_dim] = torch.view_as_real(pairs * rotation).flatten(-2)
        expected.append(x.view(5, -1))
    rotary_embedding(positions, query, key, head_size, cache, is_neox=False)
    torch.testing.assert_close(query, expected[0])
    torch.testing.assert_close(key, expected[1])


def test_partial_rotary_leaves_the_tail_alone():
    positions, query, key = _inputs(4, 2, 2, 32, torch.float32)
    before = query.clone()
    rotary_embedding_ref(positions, query, key, 32, _cos_sin_cache(128, 16), is_neox=True)
    heads, heads_before = query.view(4, 2, 32), before.view(4, 2, 32)
    assert torch.equal(heads[..., 16:], heads_before[..., 16:])
    assert not torch.equal(heads[..., :16], heads_before[..., :16])


def test_rotates_strided_views_in_place():
    """q and k arrive as column slices of the fused qkv projection."""
    positions = torch.arange(3)
    qkv = torch.randn(3, 4 * 16)
    expected_q, expected_k = qkv[:, :32].clone(), qkv[:, 32:48].clone()
    cache = _cos_sin_cache(16, 16)
    rotary_embedding_ref(positions, expected_q, expected_k, 16, cache, is_neox=True)
    q, k, _ = qkv.split([32, 16, 16], dim=-1)
    rotary_embedding_ref(positions, q, k, 16, cache, is_neox=True)
    assert torch.equal(qkv[:, :32], expected_q) and torch.equal(qkv[:, 32:48], expected_k)


# --- the compiled op against the reference (GPU) ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
@pytest.mark.parametrize("cache_in_float32", [True, False])
def test_rotary_embedding_csrc_matches_reference(is_neox, head_size, rotary_dim, dtype, cache_in_float32):
    num_tokens, num_heads, num_kv_heads = 19, 8, 2
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cache = _cos_sin_cache(4096, rotary_dim).to("cuda", torch.float32 if cache_in_float32 else dtype)
    # q and k as column slices of a fused qkv projection.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device="cuda")
    query, key, _ = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    query_ref, key_ref = query.clone(), key.clone()
    csrc_op("rotary_embedding")(positions, query, key, head_size, cache, is_neox)
    rotary_embedding_ref(positions, query_ref, key_ref, head_size, cache, is_neox)
    torch.testing.assert_close(query, query_ref, **tolerance(dtype))
    torch.testing.assert_close(key, key_ref, **tolerance(dtype))


@pytest.mark.gpu
def test_rotary_embedding_csrc_int32_positions_and_3d_heads():
    positions = torch.randint(0, 128, (5,), device="cuda", dtype=torch.int32)
    query = torch.randn(5, 4, 32, device="cuda")
    key = torch.randn(5, 2, 32, device="cuda")
    cache = _cos_sin_cache(128, 32).cuda()
    query_ref, key_ref = query.clone(), key.clone()
    csrc_op("rotary_embedding")(positions, query, key, 32, cache, True)
    rotary_embedding_ref(positions, query_ref, key_ref, 32, cache, True)
    torch.testing.assert_close(query, query_ref, **tolerance(torch.float32))
    torch.testing.assert_close(key, key_ref, **tolerance(torch.float32))
