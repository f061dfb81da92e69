"""`per_token_group_quant_fp8` on the GPU (semantics and reference:
shoal/kernels/per_token_group_quant_fp8.py): one program per (token, group) loads the group,
takes its amax, writes the group's scale and its values divided by it in e4m3.

Nothing reads back to the host, and the number of tokens only sizes the grid, so a decode
step's launch can be captured in a CUDA graph and a new batch size compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.scaled_fp8_quant import FP8_MAX


@triton.jit
def _per_token_group_quant_fp8_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    hidden,
    group_size,
    num_groups,
    stride_x,
    stride_out,
    stride_scale_token,
    stride_scale_group,
    eps,
    fp8_max,
    BLOCK: tl.constexpr,
):
    """BLOCK is group_size rounded up to a power of two; the columns past the group (or past
    hidden, in a short last group) are masked and read as 0, which changes no amax."""
    pid = tl.program_id(0)
    token = (pid // num_groups).to(tl.int64)
    group = pid % num_groups
    offsets = tl.arange(0, BLOCK)
    cols = group * group_size + offsets
    mask = (offsets < group_size) & (cols < hidden)
    x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (Triton may lower float32 `/` to an approximate one): scales and values equal
    # the reference's bit for bit.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x)), eps), fp8_max)
    quantized = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    tl.store(out_ptr + token * stride_out + cols, quantized.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + token * stride_scale_token + group * stride_scale_group, scale)


def triton_per_token_group_quant_fp8(
    out: torch.Tensor, scales: torch.Tensor, input: torch.Tensor, group_size: int, eps: float
) -> None:
    """The registered "per_token_group_quant_fp8": input and out [num_tokens, hidden] row-major,
    scales [num_tokens, num_groups] row- or column-major (its strides are passed)."""
    num_tokens, hidden = input.shape
    num_groups = scales.shape[1]
    if num_tokens == 0:
        return
    _per_token_group_quant_fp8_kernel[(num_tokens * num_groups,)](
        input, out, scales, hidden, group_size, num_groups,
        input.stride(0), out.stride(0), scales.stride(0), scales.stride(1), eps, FP8_MAX,
        BLOCK=triton.next_power_of_2(group_size),
        num_warps=1 if group_size <= 256 else 4,
    )  # fmt: skip
