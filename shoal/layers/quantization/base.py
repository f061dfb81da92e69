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

from shoal.kernels import gemv
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

    def apply_swiglu(self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`apply` to silu(gate) * up for gate_up [..., 2 * input_size] = [gate, up], as one fused
        kernel; None where the method has none for these rows (the layer runs the two ops)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model's dtype, applied with F.linear, or at decode batch sizes with the
    gemv kernel where it is faster (shoal/kernels/gemv.py)."""

    def create_weights(self, layer: Any, weight_loader: WeightLoader) -> None:
        layer.weight = new_parameter(layer.output_size, layer.input_size, weight_loader=weight_loader)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv.linear(x, layer.weight, bias)

    def apply_swiglu(self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return gemv.swiglu_linear(gate_up, layer.weight, bias)
