from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.layers.activation import silu_and_mul


def test_silu_and_mul_layer():
    x = torch.randn(3, 5, 8)
    assert torch.equal(silu_and_mul(x), F.silu(x[..., :4]) * x[..., 4:])
