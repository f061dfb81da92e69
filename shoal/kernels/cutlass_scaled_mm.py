"""fp8 GEMM with scales and bias, with the semantics of the CUDA op `cutlass_scaled_mm`:

    out = (a_scale * b_scale * (a @ b) + bias).to(out_dtype)

a [M, K] and b [K, N] are float8_e4m3fn, a row-major and b column-major (b.t() is a contiguous
[N, K] weight, the convention of torch._scaled_mm); a_scale is per tensor ([1]) or per token
([M] or [M, 1]), b_scale per tensor or per output channel ([N] or [1, N]); bias is [N] in
out_dtype. The reference dequantizes to float32, multiplies and scales there, and casts once.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op


def cutlass_scaled_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> out [M, N] in out_dtype."""
    acc = a.to(torch.float32) @ b.to(torch.float32)  # [M, N]
    out = acc * a_scale.reshape(-1, 1).to(torch.float32) * b_scale.reshape(1, -1).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def cutlass_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compiled schema: `cutlass_scaled_mm(out, a, b, a_scale, b_scale, bias) -> ()` with scales
    flattened to [1], [M] or [N]."""
    op = compiled_op("cutlass_scaled_mm", a)
    if op is None:
        return cutlass_scaled_mm_ref(a, b, a_scale, b_scale, out_dtype, bias)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    op(out, a, b, a_scale.reshape(-1), b_scale.reshape(-1), bias)
    return out
