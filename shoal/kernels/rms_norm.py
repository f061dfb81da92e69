"""RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization") and its fused
residual-add variant, with the semantics of the CUDA ops `rms_norm` / `fused_add_rms_norm`.

The reference matches Hugging Face's `LlamaRMSNorm` operation by operation: normalize in
float32, cast back to the input dtype, then multiply by the weight in that dtype.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_fp32 = x.to(torch.float32)
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_ref(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = rmsnorm(x) * weight, over the last dimension."""
    out.copy_(_normalize(x, weight, eps))


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = x + residual, then x = rmsnorm(residual) * weight."""
    residual.add_(x)
    x.copy_(_normalize(residual, weight, eps))


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    op = compiled_op("rms_norm", x)
    if op is None:
        rms_norm_ref(out, x, weight, eps)
    else:
        op(out, x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    op = compiled_op("fused_add_rms_norm", x)
    if op is None:
        fused_add_rms_norm_ref(x, residual, weight, eps)
    else:
        op(x, residual, weight, eps)
