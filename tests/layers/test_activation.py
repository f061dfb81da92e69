from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.layers.activation import SiluAndMul


def test_silu_and_mul_layer():
    x = torch.randn(3, 5, 8)
    assert torch.equal(SiluAndMul()(x), F.silu(x[..., :4]) * x[..., 4:])
