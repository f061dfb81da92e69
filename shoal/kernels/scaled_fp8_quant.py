"""Quantize to fp8 e4m3 (Micikevicius et al., 2022, "FP8 Formats for Deep Learning") with one
scale per tensor or per token, with the semantics of the CUDA op `scaled_fp8_quant`:

    out = round_e4m3(clamp(x / scale, -448, 448))

The scale is given (static, per tensor) or computed from the data (dynamic): amax / 448 over
the tensor or over each token's row, floored at MIN_SCALE so that an all-zero row divides by a
positive number. Dequantization is out.float() * scale.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _dynamic_scale(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """x float32 [..., hidden] -> scale [..., 1] per token, or [1] per tensor."""
    if per_token:
        amax = x.abs().amax(dim=-1, keepdim=True) if x.numel() else x.new_zeros((*x.shape[:-1], 1))
    else:
        amax = x.abs().amax().reshape(1) if x.numel() else x.new_zeros(1)
    return (amax / FP8_MAX).clamp(min=MIN_SCALE)


def scaled_fp8_quant_ref(
    input: torch.Tensor, scale: torch.Tensor | None = None, per_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """input [..., hidden] -> (out [..., hidden] float8_e4m3fn, scale float32 [1] or [..., 1])."""
    if scale is not None and per_token:
        raise ValueError("a static scale is per tensor")
    x = input.to(torch.float32)
    if scale is None:
        scale = _dynamic_scale(x, per_token)
    out = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return out, scale


def scaled_fp8_quant(
    input: torch.Tensor, scale: torch.Tensor | None = None, per_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled schema: `scaled_fp8_quant(out, input, scale, is_static, per_token) -> ()`; a
    dynamic scale is written into `scale`."""
    op = compiled_op("scaled_fp8_quant", input)
    if op is None:
        return scaled_fp8_quant_ref(input, scale, per_token)
    if scale is not None and per_token:
        raise ValueError("a static scale is per tensor")
    out = torch.empty(input.shape, dtype=FP8_DTYPE, device=input.device)
    is_static = scale is not None
    if scale is None:
        shape = (*input.shape[:-1], 1) if per_token else (1,)
        scale = torch.empty(shape, dtype=torch.float32, device=input.device)
    op(out, input, scale, is_static, per_token)
    return out, scale
