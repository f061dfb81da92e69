"""Activation functions of the MLP."""

from __future__ import annotations

import torch

from shoal.kernels import silu_and_mul as ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020, "GLU Variants Improve Transformer"): x [..., 2d] holds
    [gate, up]; returns silu(gate) * up [..., d]."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)  # [..., d]
    ops.silu_and_mul(out, x)
    return out
