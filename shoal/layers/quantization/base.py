"""The interface between a linear layer and the number format of its weight.

The layer (shoal/layers/linear.py) owns the tensor-parallel split: which rows or columns of a
checkpoint tensor this rank holds, through each parameter's `weight_loader`. Its `LinearMethod`
owns the number format: which parameters hold the weight (a float matrix, or fp8 values and
their scales), how they change once loaded, and how `y = x W^T + b` is computed from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shoal.kernels.gemv import gemv_kernel_for
from shoal.layers.weight_utils import new_parameter

WeightLoader = Callable[..., None]


class LinearMethod:
    """How a linear layer (`layer`, a LinearBase) stores its [output_size, input_size] weight
    (sizes per rank) and applies it. `create_weights` runs in the layer's constructor,
    `process_weights_after_loading` once after the checkpoint is loaded
    (shoal/models/loader.py), `apply` on every forward."""

    def create_weights(self, layer: Any, weight_loader: WeightLoader) -> None:
        """Register `layer.weight` (and any scales), each with a `weight_loader`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Any) -> None:
        """Turn the loaded checkpoint tensors into the form `apply` uses."""

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] -> x W^T + bias [..., output_size], in x's dtype."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model's dtype, applied with F.linear, or at decode batch sizes with the
    gemv kernel where it is faster (shoal/kernels/gemv.py)."""

    def create_weights(self, layer: Any, weight_loader: WeightLoader) -> None:
        layer.weight = new_parameter(layer.output_size, layer.input_size, weight_loader=weight_loader)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        kernel = gemv_kernel_for(rows, layer.weight)
        if kernel is None:
            return F.linear(x, layer.weight, bias)
        out = rows.new_empty(rows.shape[0], layer.weight.shape[0])
        kernel(out, rows, layer.weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
