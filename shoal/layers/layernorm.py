"""RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization"), optionally fused
with the residual add that precedes it in a pre-norm transformer block."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels.rms_norm import fused_add_rms_norm, rms_norm
from shoal.layers.weight_utils import new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        self.weight.data.fill_(1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given a residual, (norm(x + residual), x + residual), computed in place
        in x and residual (both must be tensors this forward owns)."""
        if residual is None:
            out = torch.empty_like(x)
            rms_norm(out, x, self.weight, self.eps)
            return out
        fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
