"""fp8 (e4m3) linear layers: W8A8 with one scale per output channel of the weight and one per
token (or one static scale per tensor) of the activations (Micikevicius et al., 2022, "FP8
Formats for Deep Learning"):

    y = (x_scale * w_scale * (x_fp8 @ w_fp8^T) + b).to(x.dtype)

computed by `cutlass_scaled_mm` (the CUDA op on GPU, its pure-torch reference on CPU).

The weight is kept as b = w_fp8.t(): a [input_size, output_size] view of a contiguous
[output_size, input_size] tensor, i.e. column-major, the layout `cutlass_scaled_mm` takes.
`weight_scale` is always one float32 per output row, [output_size]:

- quantized on the fly (`quantization="fp8"` on a float checkpoint): each row of the loaded
  float weight gets scale amax(|row|) / 448;
- from an fp8 checkpoint: a per-channel scale is loaded as is, and a per-tensor scale is
  broadcast over the rows of its tensor. So a fused layer (qkv, gate_up) whose parts were
  calibrated with different per-tensor scales keeps each part's scale exactly, with no
  requantization (and no extra rounding); the per-channel epilogue costs the GEMM nothing.

Static activation scales (`input_scale`) are per tensor; a fused layer takes the largest of its
parts' scales, so that no part's calibrated range is clipped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shoal.kernels.cutlass_scaled_mm import cutlass_scaled_mm, cutlass_scaled_mm_ref
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, scaled_fp8_quant
from shoal.layers.quantization.base import LinearMethod, WeightLoader
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.weight_utils import LoadedWeight

logger = logging.getLogger(__name__)

# The compiled GEMM writes bfloat16 or float16 and needs K % 16 == 0 and N % 8 == 0 (16-byte
# aligned rows for its TMA loads); anything else (float32 models, odd shapes) uses the reference.
CUTLASS_OUT_DTYPES = (torch.bfloat16, torch.float16)


def _parameter(data: torch.Tensor, weight_loader: WeightLoader | None = None) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if weight_loader is not None:
        param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class Fp8LinearMethod(LinearMethod):
    """A linear layer in fp8: `weight` float8_e4m3fn [K, N] column-major, `weight_scale` float32
    [N], and `input_scale` float32 [1] for static activation scales (see the module docstring)."""

    def __init__(self, config: Fp8Config):
        self.config = config

    @property
    def is_static(self) -> bool:
        return self.config.activation_scheme == "static"

    # ---- parameters and loading ----------------------------------------------------------

    def create_weights(self, layer: Any, weight_loader: WeightLoader) -> None:
        rows, cols = layer.output_size, layer.input_size
        if not self.config.is_checkpoint_fp8:  # a float weight, quantized once loaded
            layer.weight = _parameter(torch.empty(rows, cols), weight_loader)
            return
        layer.weight = _parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), weight_loader)
        scale_loader = _weight_scale_loader(layer, weight_loader)
        layer.weight_scale = _parameter(torch.empty(rows, dtype=torch.float32), scale_loader)
        if self.is_static:
            layer.input_scale = _parameter(torch.zeros(1, dtype=torch.float32), _load_input_scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.config.is_checkpoint_fp8:
            weight, weight_scale = layer.weight.data, layer.weight_scale.data
        else:
            # Each output row of the weight is one "token" of the per-token quantizer: per-channel scales.
            weight, scale = scaled_fp8_quant(layer.weight.data, per_token=True)  # [N, K] fp8, [N, 1]
            weight_scale = scale.reshape(-1)  # [N]
        layer.weight = _parameter(weight.t())  # [K, N], column-major
        layer.weight_scale = _parameter(weight_scale.contiguous())

    # ---- forward ---------------------------------------------------------------------------

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_2d = x.reshape(-1, x.shape[-1])  # [num_tokens, input_size]
        if self.is_static:
            x_fp8, x_scale = scaled_fp8_quant(x_2d, layer.input_scale)  # x_scale [1]
        else:
            x_fp8, x_scale = scaled_fp8_quant(x_2d, per_token=True)  # x_scale [num_tokens, 1]
        y = _scaled_mm(x_fp8, layer.weight, x_scale, layer.weight_scale, x.dtype, bias)  # [num_tokens, output_size]
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """cutlass_scaled_mm where the compiled op takes these operands, else the reference."""
    k, n = b.shape
    if out_dtype in CUTLASS_OUT_DTYPES and k % 16 == 0 and n % 8 == 0:
        return cutlass_scaled_mm(a, b, a_scale, b_scale, out_dtype, bias)
    return cutlass_scaled_mm_ref(a, b, a_scale, b_scale, out_dtype, bias)


def _read_scale(loaded: LoadedWeight) -> torch.Tensor:
    """A scale tensor as float32 [numel]; `[...]` also reads a 0-dim lazy slice (a per-tensor
    scale is often stored with shape [])."""
    scale = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
    return scale.to(torch.float32).reshape(-1)


def _weight_scale_loader(layer: Any, weight_loader: WeightLoader) -> WeightLoader:
    """Load a checkpoint `weight_scale` into the per-row scales of the layer's weight.

    A per-tensor scale is broadcast to one entry per row of its checkpoint tensor, and a
    per-channel one ([rows] or [rows, 1]) flattened to [rows]; the layer's own `weight_loader`
    then picks this rank's rows exactly as it does for the weight (shard_id says which part of
    a fused layer the tensor is)."""

    def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        scale = _read_scale(loaded)
        rows = layer.checkpoint_output_size(shard_id)
        if scale.numel() == 1:
            scale = scale.expand(rows)
        elif scale.numel() != rows:
            raise ValueError(
                f"weight_scale has {scale.numel()} entries; expected 1 (per tensor) or {rows} (per channel)"
            )
        if shard_id is None:
            weight_loader(param, scale)
        else:
            weight_loader(param, scale, shard_id)

    return load


def _load_input_scale(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
    """A static per-tensor activation scale; the parts of a fused layer keep the largest."""
    scale = _read_scale(loaded)
    if scale.numel() != 1:
        raise ValueError(f"input_scale has {scale.numel()} entries; static activation scales are per tensor")
    param.data.copy_(torch.maximum(param.data, scale.to(param.device)))
