"""One attention layer's per-head q/k RMSNorm (optional, Qwen3's QK-norm), rotary embedding and
KV-cache write as a single op.

At decode each of the separate ops (`rms_norm` twice, `rotary_embedding`, `reshape_and_cache`)
is a launch of a few microseconds that does almost no work; fused, a layer launches one kernel.
The semantics are exactly those ops in sequence, on the fused qkv projection
[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]:

1. with norm weights, every query head is RMSNorm-ed with `q_norm_weight` and every key head
   with `k_norm_weight`, in place;
2. the first `rotary_dim = cos_sin_cache.shape[-1]` features of every query and key head are
   rotated in place (neox or GPT-J pairs);
3. each token's keys and values are written to `kv_cache` at `slot_mapping[t]` (-1: not written).

Only float16 / bfloat16 on CUDA take the compiled (Triton) kernel: float32 keeps the separate
ops, whose GPU results agree with Hugging Face bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.kernels.dispatch import registered_kernel
from shoal.kernels.reshape_and_cache import reshape_and_cache_ref
from shoal.kernels.rms_norm import rms_norm_ref
from shoal.kernels.rotary_embedding import rotary_embedding_ref

FUSED_DTYPES = (torch.float16, torch.bfloat16)


def _compiled_kernel(qkv: torch.Tensor) -> Callable[..., object] | None:
    return registered_kernel("rope_and_cache", qkv) if qkv.dtype in FUSED_DTYPES else None


def fused_rope_and_cache_available(qkv: torch.Tensor) -> bool:
    """Whether `rope_and_cache` runs as one compiled kernel for `qkv` (else a model should keep
    the separate ops, which have compiled versions of their own)."""
    return _compiled_kernel(qkv) is not None


def rope_and_cache_ref(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """The separate references in sequence; q_norm_weight and k_norm_weight come both or neither."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # views of qkv, [num_tokens, *_size]
    if q_norm_weight is not None:
        for x, weight in ((q, q_norm_weight), (k, k_norm_weight)):
            heads = x.view(num_tokens, -1, head_size)  # [num_tokens, num_(kv_)heads, head_size], in qkv
            rms_norm_ref(heads, heads, weight, eps)
    rotary_embedding_ref(positions, q, k, head_size, cos_sin_cache, is_neox)
    key = k.view(num_tokens, num_kv_heads, head_size)  # [num_tokens, num_kv_heads, head_size]
    value = v.view(num_tokens, num_kv_heads, head_size)  # [num_tokens, num_kv_heads, head_size]
    reshape_and_cache_ref(key, value, kv_cache, slot_mapping)


def rope_and_cache(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    (_compiled_kernel(qkv) or rope_and_cache_ref)(
        positions, qkv, kv_cache, slot_mapping, cos_sin_cache, num_heads, num_kv_heads, head_size, is_neox,
        q_norm_weight, k_norm_weight, eps,
    )  # fmt: skip
