"""Quantize activations to fp8 e4m3 with one scale per token and group of `group_size`
consecutive features, the activation side of block-wise fp8 W8A8 (DeepSeek-AI, 2024,
"DeepSeek-V3 Technical Report", section 3.3.2: 1x128 tiles for activations, 128x128 blocks
for weights):

    scale[t, g] = max(amax(|x[t, g * group_size : (g + 1) * group_size]|), eps) / 448
    out[t, i]   = round_e4m3(clamp(x[t, i] / scale[t, i // group_size], -448, 448))

A hidden size that is not a multiple of `group_size` leaves a shorter last group. Dequantization
is out.float() * scale repeated over each group. `column_major_scales` returns the scales of a
2-D input as the transpose of a contiguous [num_groups, num_tokens] tensor (the layout some
GEMMs read); the values are the same.

`eps` floors the amax of an all-zero group, so that no scale is zero (its values quantize to 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import compiled_op
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX

DEFAULT_EPS = 1e-10


def num_groups(hidden: int, group_size: int) -> int:
    return -(-hidden // group_size)


def _check(input: torch.Tensor, group_size: int, column_major_scales: bool) -> None:
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if column_major_scales and input.dim() != 2:
        raise ValueError("column-major scales need a 2-D input [num_tokens, hidden]")


def _scales_like(input: torch.Tensor, group_size: int, column_major_scales: bool) -> torch.Tensor:
    """An uninitialized float32 [..., num_groups] scale tensor in the requested layout."""
    groups = num_groups(input.shape[-1], group_size)
    if column_major_scales:
        return torch.empty(groups, input.shape[0], dtype=torch.float32, device=input.device).t()
    return torch.empty(*input.shape[:-1], groups, dtype=torch.float32, device=input.device)


def per_token_group_quant_fp8_ref(
    input: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """input [..., hidden] -> (out float8_e4m3fn [..., hidden], scales float32 [..., num_groups])."""
    _check(input, group_size, column_major_scales)
    hidden = input.shape[-1]
    groups = num_groups(hidden, group_size)
    # Zero padding to whole groups changes no amax (and is cut off again below).
    padded = F.pad(input.to(torch.float32), (0, groups * group_size - hidden))
    grouped = padded.reshape(*input.shape[:-1], groups, group_size)  # [..., num_groups, group_size]
    # Divided by a tensor, not the Python number: CUDA torch turns division by a host scalar into
    # multiplication by its reciprocal, a last-bit difference that moves the values sitting on
    # an e4m3 rounding boundary (common for bfloat16 inputs); the kernel divides in IEEE.
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=input.device)
    scales = grouped.abs().amax(dim=-1).clamp(min=eps) / fp8_max  # [..., num_groups]
    quantized = (grouped / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = quantized.reshape(*input.shape[:-1], groups * group_size)[..., :hidden].contiguous()
    if column_major_scales:
        # Into the kernel's own layout (`.t().contiguous().t()` keeps row-major strides when a
        # dimension has size 1, as with one token).
        scales = _scales_like(input, group_size, True).copy_(scales)
    return out, scales


def dequantize_per_token_group(x_fp8: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 values that (x_fp8, scales) of `per_token_group_quant_fp8` stand for."""
    hidden = x_fp8.shape[-1]
    return x_fp8.to(torch.float32) * scales.repeat_interleave(group_size, dim=-1)[..., :hidden]


def per_token_group_quant_fp8(
    input: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled schema: `per_token_group_quant_fp8(out, scales, input, group_size, eps) -> ()`
    with input and out [num_tokens, hidden] row-major and scales [num_tokens, num_groups] in
    either layout (the kernel takes its strides)."""
    op = compiled_op("per_token_group_quant_fp8", input)
    if op is None:
        return per_token_group_quant_fp8_ref(input, group_size, eps, column_major_scales)
    _check(input, group_size, column_major_scales)
    input = input.contiguous()
    out = torch.empty(input.shape, dtype=FP8_DTYPE, device=input.device)
    scales = _scales_like(input, group_size, column_major_scales)
    hidden = input.shape[-1]
    scales_2d = scales if column_major_scales else scales.view(-1, scales.shape[-1])  # [num_tokens, num_groups]
    op(out.view(-1, hidden), scales_2d, input.view(-1, hidden), group_size, eps)
    return out, scales
