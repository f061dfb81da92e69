"""Activation functions of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels.silu_and_mul import silu_and_mul


class SiluAndMul(nn.Module):
    """SwiGLU's gate (Shazeer, 2020, "GLU Variants Improve Transformer"): x [..., 2d] holds
    [gate, up]; returns silu(gate) * up [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)  # [..., d]
        silu_and_mul(out, x)
        return out
