"""The block-scaled fp8 GEMM of block-wise W8A8 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical
Report", section 3.3.2): activations with one scale per token and group of block_k features
(shoal/kernels/per_token_group_quant_fp8.py), weights with one scale per block of
block_n x block_k:

    out[m, n] = sum_g a_scale[m, g] * b_scale[n // block_n, g] * sum_{k in group g} a[m, k] * b[n, k]

a [M, K] and b [N, K] are float8_e4m3fn, both K-contiguous (b is the checkpoint's [out, in]
weight as stored); a_scale float32 [M, ceil(K / block_k)], b_scale float32
[ceil(N / block_n), ceil(K / block_k)] (the checkpoint's `weight_scale_inv`); out [M, N] in
out_dtype. Sizes need not be multiples of the blocks: the last block of a row or column is
shorter.

The reference dequantizes both operands to float32 and multiplies there, which is the same sum
in another order. On CUDA the Triton kernel (shoal/kernels/triton/w8a8_block_fp8_matmul.py)
accumulates each group's fp8 product in float32 and scales it as it goes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import compiled_op
from shoal.kernels.per_token_group_quant_fp8 import dequantize_per_token_group
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """weight [..., N, K] e4m3 and its block scales [..., ceil(N / block_n), ceil(K / block_k)]
    -> float32 [..., N, K] (the leading dimensions are experts, for stacked MoE weights)."""
    block_n, block_k = block_size
    n, k = weight.shape[-2:]
    expanded = scale_inv.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return weight.to(torch.float32) * expanded[..., :n, :k]


def quantize_block_fp8(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N / block_n),
    ceil(K / block_k)]) with each block's scale its amax / 448 (a zero block gets 1), the way
    block-wise fp8 checkpoints are written (tests and dummy weights write them so too)."""
    block_n, block_k = block_size
    n, k = weight.shape[-2:]
    rows, cols = -(-n // block_n), -(-k // block_k)
    padded = F.pad(weight.to(torch.float32), (0, cols * block_k - k, 0, rows * block_n - n))
    blocks = padded.unflatten(-1, (cols, block_k)).unflatten(-3, (rows, block_n))  # [..., rows, bn, cols, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rows, cols]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale_inv.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)[..., :n, :k]
    quantized = (weight.to(torch.float32) / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale_inv


def check_block_scales(b: torch.Tensor, b_scale: torch.Tensor, block_size: tuple[int, int]) -> None:
    block_n, block_k = block_size
    n, k = b.shape[-2:]
    expected = (-(-n // block_n), -(-k // block_k))
    if tuple(b_scale.shape[-2:]) != expected:
        raise ValueError(
            f"block scales of shape {tuple(b_scale.shape)} do not fit a [{n}, {k}] weight in "
            f"{block_n}x{block_k} blocks (expected {expected})"
        )


def w8a8_block_fp8_matmul_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """-> out [M, N] in out_dtype (see the module docstring)."""
    check_block_scales(b, b_scale, block_size)
    a_deq = dequantize_per_token_group(a, a_scale, block_size[1])  # [M, K]
    return (a_deq @ dequantize_block_fp8(b, b_scale, block_size).t()).to(out_dtype)


def w8a8_block_fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    block_size: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Compiled schema: `w8a8_block_fp8_matmul(out, a, b, a_scale, b_scale, block_n, block_k) -> ()`."""
    op = compiled_op("w8a8_block_fp8_matmul", a)
    if op is None:
        return w8a8_block_fp8_matmul_ref(a, b, a_scale, b_scale, block_size, out_dtype)
    check_block_scales(b, b_scale, block_size)
    out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    op(out, a, b, a_scale, b_scale, block_size[0], block_size[1])
    return out
