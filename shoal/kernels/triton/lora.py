"""Batched LoRA shrink and expand on the GPU, a token at a time (semantics and references:
shoal/kernels/lora.py): the MoE experts' LoRA (shoal/kernels/triton/fused_moe_lora.py), whose
entries are not sorted by slot; the dense layers take the segment kernels (lora_segments.py).

Shrink: one program per (token, block of K): the token's slot picks its A, the program takes
the dot of its piece of x with every rank row and adds it into h (float32) atomically, so long
inputs spread over many programs at decode. Expand: one program per (token, block of outputs):
h [R] times the slot's B block [BLOCK_N, R], added into y. A token of the base model (slot -1)
returns at once. The number of tokens only sizes the grid, so a decode step's launches are
captured in a CUDA graph with the slots in a static buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, h_ptr,
    in_size, rank,
    stride_x, stride_a_slot, stride_a_rank, stride_h,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    k_block = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ks = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    x = tl.load(x_ptr + token * stride_x + ks, mask=ks < in_size, other=0.0).to(tl.float32)  # [BLOCK_K]
    a_rows = a_ptr + slot * stride_a_slot + rs[:, None] * stride_a_rank + ks[None, :]
    a = tl.load(a_rows, mask=(rs[:, None] < rank) & (ks[None, :] < in_size), other=0.0).to(tl.float32)
    partial = tl.sum(a * x[None, :], axis=1)  # [BLOCK_R]
    tl.atomic_add(h_ptr + token * stride_h + rs, partial, mask=rs < rank)


@triton.jit
def _lora_expand_kernel(
    y_ptr, h_ptr, b_ptr, slots_ptr,
    out_size, rank,
    stride_y, stride_h, stride_b_slot, stride_b_out,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    n_block = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ns = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + token * stride_h + rs, mask=rs < rank, other=0.0)  # [BLOCK_R] float32
    b_rows = b_ptr + slot * stride_b_slot + ns[:, None] * stride_b_out + rs[None, :]
    b = tl.load(b_rows, mask=(ns[:, None] < out_size) & (rs[None, :] < rank), other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)  # [BLOCK_N]
    y_at = y_ptr + token * stride_y + ns
    y = tl.load(y_at, mask=ns < out_size, other=0.0).to(tl.float32)
    tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=ns < out_size)


def triton_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`lora_shrink_ref`'s arguments and result."""
    num_tokens, in_size = x.shape
    _, rank, _ = lora_a.shape
    h = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    x = x if x.stride(1) == 1 else x.contiguous()
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(triton.next_power_of_2(in_size), 8192 // block_r))
    grid = (num_tokens, triton.cdiv(in_size, block_k))
    _lora_shrink_kernel[grid](
        x, lora_a, slots, h, in_size, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_K=block_k, BLOCK_R=block_r,
    )  # fmt: skip
    return h


def triton_lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`lora_expand_ref`'s arguments; y updated in place and returned."""
    num_tokens, out_size = y.shape
    rank = lora_b.shape[2]
    if num_tokens == 0:
        return y
    block_r = triton.next_power_of_2(rank)
    block_n = max(16, min(triton.next_power_of_2(out_size), 8192 // block_r))
    grid = (num_tokens, triton.cdiv(out_size, block_n))
    _lora_expand_kernel[grid](
        y, h, lora_b, slots, out_size, rank,
        y.stride(0), h.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return y
