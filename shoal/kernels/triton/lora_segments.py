"""Batched LoRA shrink and expand over a step's tokens sorted by adapter slot (the SGMV idea of
Punica and S-LoRA; semantics and references: shoal/kernels/lora.py).

The per-token kernels (shoal/kernels/triton/lora.py) read a token's whole A or B for every
token: at a decode batch of 256 an expand of a gate_up projection reads its 1.8 MB B 256 times.
Here a program takes a tile of up to BLOCK_M tokens of one slot (from `LoRASegments`) and loads
each piece of that slot's A or B once for the tile, as a tensor-core product.

Grid: (tiles, K splits for the shrink / output blocks for the expand). A tile is up to BLOCK_M
tokens of one slot, the tiles of slot 0 first; a program finds its slot and tile by walking the
slots' counts. T tokens over S slots make at most cdiv(T, BLOCK_M) + min(S, T) - 1 tiles (each
used slot adds at most one partial tile), so the grid depends only on T and S and a decode step
replays in a CUDA graph with the segments in static buffers, and a batch-1 step launches one
tile's programs, not one per slot. Programs past the step's tiles return at once.

Shrink: each program adds its K split's partial product into h (float32, atomically: at decode
the splits spread the long K over many programs). Expand: each (token, output) element is
written by one program, h rounded to B's dtype for the product (as the grouped GEMMs do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.lora import LoRASegments
from shoal.kernels.triton.precision import dot_precision

# K elements a shrink program reduces (BLOCK_K at a time): a 4096-wide input is 16 programs a tile.
_K_PER_SPLIT = 256
_BLOCK_K = 64
_BLOCK_N = 64


def _block_m(num_tokens: int) -> int:
    return min(64, max(16, triton.next_power_of_2(num_tokens)))


def _max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    return triton.cdiv(num_tokens, block_m) + min(num_slots, num_tokens) - 1


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest side


@triton.jit
def _tile_tokens(sorted_tokens_ptr, starts_ptr, counts_ptr, num_slots, tile, BLOCK_M: tl.constexpr):
    """This program's tile: (slot, -1 past the step's tiles; token indices [BLOCK_M] int64; mask)."""
    slot = -1
    m_block = 0
    count = 0  # the slot's tokens (0 past the step's tiles: no token valid)
    first = 0  # the first tile of slot s
    for s in range(0, num_slots):
        tokens_of_s = tl.load(counts_ptr + s)
        tiles = (tokens_of_s + BLOCK_M - 1) // BLOCK_M
        here = (tile >= first) & (tile < first + tiles)
        slot = tl.where(here, s, slot)
        m_block = tl.where(here, tile - first, m_block)
        count = tl.where(here, tokens_of_s, count)
        first += tiles
    ms = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = ms < count
    start = tl.load(starts_ptr + tl.maximum(slot, 0))
    tokens = tl.load(sorted_tokens_ptr + start + ms, mask=valid, other=0).to(tl.int64)
    return slot, tokens, valid


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, sorted_tokens_ptr, starts_ptr, counts_ptr,
    num_slots, in_size, rank,
    stride_x, stride_a_slot, stride_a_rank, stride_h,
    K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    slot, tokens, valid = _tile_tokens(sorted_tokens_ptr, starts_ptr, counts_ptr, num_slots, tl.program_id(0), BLOCK_M)
    if slot >= 0:
        slot = slot.to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k_start in range(split * K_PER_SPLIT, split * K_PER_SPLIT + K_PER_SPLIT, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_valid = ks < in_size
            x = tl.load(
                x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=valid[:, None] & k_valid[None, :], other=0.0
            )
            a_at = a_ptr + slot * stride_a_slot + rs[:, None] * stride_a_rank + ks[None, :]
            a = tl.load(a_at, mask=(rs[:, None] < rank) & k_valid[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_R]
        h_at = h_ptr + tokens[:, None] * stride_h + rs[None, :]
        tl.atomic_add(h_at, acc, mask=valid[:, None] & (rs[None, :] < rank))


@triton.jit
def _expand_kernel(
    y_ptr, h_ptr, b_ptr, sorted_tokens_ptr, starts_ptr, counts_ptr,
    num_slots, out_size, rank,
    stride_y, stride_h, stride_b_slot, stride_b_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    n_block = tl.program_id(1)
    slot, tokens, valid = _tile_tokens(sorted_tokens_ptr, starts_ptr, counts_ptr, num_slots, tl.program_id(0), BLOCK_M)
    if slot >= 0:
        slot = slot.to(tl.int64)
        rs = tl.arange(0, BLOCK_R)
        ns = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = ns < out_size
        h = tl.load(
            h_ptr + tokens[:, None] * stride_h + rs[None, :], mask=valid[:, None] & (rs[None, :] < rank), other=0.0
        )
        b_at = b_ptr + slot * stride_b_slot + ns[:, None] * stride_b_out + rs[None, :]
        b = tl.load(b_at, mask=n_valid[:, None] & (rs[None, :] < rank), other=0.0)  # [BLOCK_N, BLOCK_R]
        delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
        y_at = y_ptr + tokens[:, None] * stride_y + ns[None, :]
        mask = valid[:, None] & n_valid[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def triton_lora_shrink_segments(x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """The registered "lora_shrink_segments": h [T, R] float32 = A[slot] x per token (0 for the
    base model's tokens)."""
    num_tokens, in_size = x.shape
    num_slots, rank, _ = lora_a.shape
    h = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = _block_m(num_tokens)
    grid = (_max_tiles(num_tokens, num_slots, block_m), triton.cdiv(in_size, _K_PER_SPLIT))
    _shrink_kernel[grid](
        x, lora_a, h, segments.sorted_tokens, segments.starts, segments.counts, num_slots, in_size, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        K_PER_SPLIT=_K_PER_SPLIT, BLOCK_M=block_m, BLOCK_K=_BLOCK_K, BLOCK_R=_block_r(rank),
        DOT_PRECISION=dot_precision(x.dtype),
    )  # fmt: skip
    return h


def triton_lora_expand_segments(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """The registered "lora_expand_segments": y [T, out] += B[slot] h per token; returns y."""
    num_tokens, out_size = y.shape
    num_slots, _, rank = lora_b.shape
    if num_tokens == 0:
        return y
    block_m = _block_m(num_tokens)
    grid = (_max_tiles(num_tokens, num_slots, block_m), triton.cdiv(out_size, _BLOCK_N))
    _expand_kernel[grid](
        y, h, lora_b, segments.sorted_tokens, segments.starts, segments.counts, num_slots, out_size, rank,
        y.stride(0), h.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_R=_block_r(rank),
        DOT_PRECISION=dot_precision(lora_b.dtype),
    )  # fmt: skip
    return y
