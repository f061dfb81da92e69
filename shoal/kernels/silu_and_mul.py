"""The SwiGLU gate (Shazeer, 2020, "GLU Variants Improve Transformer"): silu(gate) * up, with
the semantics of the CUDA op `silu_and_mul` (gate and up concatenated on the last dimension)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import compiled_op


def silu_and_mul_ref(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [..., d] = silu(x[..., :d]) * x[..., d:] for x [..., 2d]."""
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    op = compiled_op("silu_and_mul", x)
    if op is None:
        silu_and_mul_ref(out, x)
    else:
        op(out, x)
