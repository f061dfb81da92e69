"""`rope_and_cache` as one Triton kernel (semantics and reference: shoal/kernels/rope_and_cache.py).

One program per (token, head), query heads first and then KV heads, as they sit in the qkv row.
At decode a batch has few tokens, so a program per token would leave most of the GPU idle and
run its heads one after another; per (token, head), even one token spreads over
num_heads + num_kv_heads programs, each one warp on a few hundred bytes. A KV-head program also
writes its key head and copies the matching value head into the cache.

Each lane holds one feature of the head and also loads its rotation partner (the other member of
its pair), so the norm, the rotation and both stores stay whole-head vector operations.

Rounding follows the separate kernels: the norm runs in float32, is rounded to the dtype, times
the weight, rounded again (Hugging Face's RMSNorm); cos and sin are rounded to the dtype; the
rotation is computed in float32 and rounded once (the torch reference rounds each product, so a
result can differ from it by about one unit in the last place of the inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalized(x, inv_rms, weight_ptrs, mask, dtype: tl.constexpr):
    """RMSNorm of float32 features given the row's 1 / rms, with the reference's two roundings."""
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptrs, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed).to(dtype).to(tl.float32)


@triton.jit
def _normalize_and_rotate(
    row, weight_ptr, cos_sin, eps,
    HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):  # fmt: skip
    """The head at `row` after the norm (optional) and the rotation, [HEAD_BLOCK] in the dtype."""
    dtype = row.dtype.element_ty
    half = ROTARY_DIM // 2
    offs = tl.arange(0, HEAD_BLOCK)
    in_head = offs < HEAD_SIZE
    is_rotated = offs < ROTARY_DIM
    if IS_NEOX:  # pairs (i, i + half)
        is_first = offs < half
        partner = tl.where(is_first, offs + half, offs - half)
        pair = tl.where(is_first, offs, offs - half)
    else:  # pairs (2i, 2i + 1)
        is_first = offs % 2 == 0
        partner = offs ^ 1
        pair = offs // 2
    partner = tl.where(is_rotated, partner, offs)  # features past rotary_dim are their own partner
    x = tl.load(row + offs, mask=in_head, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner, mask=in_head, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, 0) / HEAD_SIZE + eps)
        x = _normalized(x, inv_rms, weight_ptr + offs, in_head, dtype)
        x_partner = _normalized(x_partner, inv_rms, weight_ptr + partner, in_head, dtype)
    cos = tl.load(cos_sin + pair, mask=is_rotated, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin + half + pair, mask=is_rotated, other=0.0).to(dtype).to(tl.float32)
    # first of a pair: x1 cos - x2 sin; second: x2 cos + x1 sin.
    rotated = tl.where(is_first, x * cos - x_partner * sin, x * cos + x_partner * sin)
    return tl.where(is_rotated, rotated, x).to(dtype)


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr, qkv_row_stride, positions_ptr, cos_sin_ptr, kv_cache_ptr, value_cache_offset, slot_mapping_ptr,
    q_norm_ptr, k_norm_ptr, eps, num_heads, num_kv_heads,
    HEAD_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # < num_heads: a query head; then the KV heads
    row = qkv_ptr + token * qkv_row_stride + head * HEAD_SIZE  # this head's features in qkv
    cos_sin = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * ROTARY_DIM  # [rotary_dim]
    offs = tl.arange(0, HEAD_BLOCK)
    in_head = offs < HEAD_SIZE
    if head < num_heads:
        out = _normalize_and_rotate(row, q_norm_ptr, cos_sin, eps, HEAD_SIZE, ROTARY_DIM, IS_NEOX, HAS_NORM, HEAD_BLOCK)
    else:
        out = _normalize_and_rotate(row, k_norm_ptr, cos_sin, eps, HEAD_SIZE, ROTARY_DIM, IS_NEOX, HAS_NORM, HEAD_BLOCK)
    tl.store(row + offs, out, mask=in_head)
    if head >= num_heads:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, nothing to write
            # kv_cache[0] row `slot` is [num_kv_heads, head_size]; kv_cache[1] lies value_cache_offset further.
            key_dst = kv_cache_ptr + slot * (num_kv_heads * HEAD_SIZE) + (head - num_heads) * HEAD_SIZE
            tl.store(key_dst + offs, out, mask=in_head)
            value = tl.load(row + num_kv_heads * HEAD_SIZE + offs, mask=in_head)  # the matching value head
            tl.store(key_dst + value_cache_offset + offs, value, mask=in_head)


def triton_rope_and_cache(
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
    """qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_size] with a contiguous last dim;
    kv_cache contiguous [2, num_blocks, block_size, num_kv_heads, head_size]; positions int32/int64,
    slot_mapping int64, cos_sin_cache contiguous [max_position, rotary_dim] (float32 or qkv's dtype)."""
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    has_norm = q_norm_weight is not None
    _rope_and_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, qkv.stride(0), positions, cos_sin_cache, kv_cache, kv_cache.stride(0), slot_mapping,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,  # unread without norm
        eps, num_heads, num_kv_heads,
        HEAD_SIZE=head_size, ROTARY_DIM=cos_sin_cache.shape[-1], IS_NEOX=is_neox, HAS_NORM=has_norm,
        HEAD_BLOCK=triton.next_power_of_2(head_size), num_warps=1,
    )  # fmt: skip
