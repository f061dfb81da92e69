"""Block-wise fp8 (e4m3) linear layers, DeepSeek-V3's W8A8 scheme (DeepSeek-AI, 2024,
"DeepSeek-V3 Technical Report", section 3.3.2):

- the weight [N, K] in float8_e4m3fn with one float32 scale per block of block_n x block_k
  (`weight_scale_inv` [ceil(N / block_n), ceil(K / block_k)], the factor that dequantizes the
  block: w = w_fp8 * weight_scale_inv[n // block_n, k // block_k]);
- the activations quantized at run time per token and group of block_k features
  (`per_token_group_quant_fp8`), so that a group of the activations meets a block of the weight
  in the GEMM (`w8a8_block_fp8_matmul`) and each product is scaled by one pair of scales.

The weight stays as the checkpoint stores it, [N, K] row-major: the GEMM reads both operands
K-contiguous.

Tensor parallelism cuts the weight and its scales together, so every cut must fall on a block
boundary: a column-parallel shard (each part of a fused qkv / gate_up layer, on every rank) must
start on a multiple of block_n rows and hold whole blocks, a row-parallel shard the same in
block_k columns. Only the end of a checkpoint tensor may cut a block short (the last block of a
dimension that is not a multiple of the block). A layout that breaks this raises ValueError at
construction, naming the layer and the tensor-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.kernels.dispatch import has_op
from shoal.kernels.per_token_group_quant_fp8 import per_token_group_quant_fp8
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE
from shoal.kernels.w8a8_block_fp8_matmul import w8a8_block_fp8_matmul
from shoal.layers.quantization.base import LinearMethod, WeightLoader
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.weight_utils import LoadedWeight, copy_weight, narrow_weight, weight_shape


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _parameter(data: torch.Tensor, weight_loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def is_block_aligned(start: int, size: int, total: int, block: int) -> bool:
    """Whether [start, start + size) of a dimension of `total` is made of whole blocks (the last
    block of the dimension may be short)."""
    return start % block == 0 and (size % block == 0 or start + size == total)


def check_block_aligned(what: str, start: int, size: int, total: int, block: int, tp_size: int) -> None:
    if not is_block_aligned(start, size, total, block):
        raise ValueError(
            f"{what}: the shard [{start}, {start + size}) of {total} does not fall on block boundaries of "
            f"{block} (weight_block_size) at tensor-parallel size {tp_size}; block-wise fp8 needs every "
            "tensor-parallel shard and every fused part to hold whole blocks"
        )


class Fp8BlockLinearMethod(LinearMethod):
    """A linear layer in block-wise fp8: `weight` float8_e4m3fn [N, K] and `weight_scale_inv`
    float32 [ceil(N / block_n), ceil(K / block_k)] (see the module docstring)."""

    def __init__(self, config: Fp8Config):
        if config.weight_block_size is None:
            raise ValueError("Fp8BlockLinearMethod needs a weight_block_size")
        self.config = config
        self.block_size: tuple[int, int] = config.weight_block_size
        # The model's dtype (the loader builds the model under it): the activations' dtype.
        self.activation_dtype = torch.get_default_dtype()

    def create_weights(self, layer: Any, weight_loader: WeightLoader) -> None:
        block_n, block_k = self.block_size
        self._check_layout(layer)
        rows, cols = layer.output_size, layer.input_size
        layer.weight = _parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), weight_loader)
        scales = torch.empty(cdiv(rows, block_n), cdiv(cols, block_k), dtype=torch.float32)
        layer.weight_scale_inv = _parameter(scales, block_scale_loader(layer, self.block_size))

    def _check_layout(self, layer: Any) -> None:
        block_n, block_k = self.block_size
        name = layer.prefix or type(layer).__name__
        for shard_id in layer.output_shard_ids():
            start, offset, size = layer.output_shard(shard_id)
            what = name if shard_id is None else f"{name} (part {shard_id!r})"
            check_block_aligned(
                f"{what} rows", start, size, layer.checkpoint_output_size(shard_id), block_n, layer.tp_size
            )
            check_block_aligned(
                f"{what} rows of the fused weight", offset, size, layer.output_size, block_n, layer.tp_size
            )
        start, size = layer.input_shard()
        check_block_aligned(f"{name} columns", start, size, layer.checkpoint_input_size(), block_k, layer.tp_size)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_2d = x.reshape(-1, x.shape[-1])  # [num_tokens, input_size]
        x_fp8, x_scale = per_token_group_quant_fp8(x_2d, self.block_size[1])  # x_scale [num_tokens, groups]
        y = w8a8_block_fp8_matmul(x_fp8, layer.weight, x_scale, layer.weight_scale_inv, self.block_size, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])  # [..., output_size]

    def warm_up_kernels(self, layer: Any, max_num_tokens: int) -> None:
        """On CUDA, run the layer once per launch configuration that batches of up to
        `max_num_tokens` tokens can pick from the GEMM's launch table, so that no step of a run
        compiles one (once per shape: layers of a shape already warmed up run nothing)."""
        weight = layer.weight
        if not has_op("w8a8_block_fp8_matmul", weight):
            return
        from shoal.kernels.triton.block_fp8_config import launch_table
        from shoal.kernels.triton.fused_moe_config import device_name, warm_up_token_counts

        n, k = weight.shape
        key = (n, k, self.block_size, self.activation_dtype, weight.device, max_num_tokens)
        if key in _WARMED_UP:
            return
        _WARMED_UP.add(key)
        table = launch_table(n, k, device_name(weight.device), self.block_size)
        for num_tokens in warm_up_token_counts(table, max_num_tokens):  # type: ignore[arg-type]
            self.apply(layer, torch.zeros(num_tokens, k, dtype=self.activation_dtype, device=weight.device), None)


_WARMED_UP: set[tuple] = set()


def block_scale_loader(layer: Any, block_size: tuple[int, int]) -> WeightLoader:
    """Load a checkpoint `weight_scale_inv` into the layer's block scales: this rank's block rows
    of each part (the rows of the weight's shard, divided by block_n) and its block columns
    (likewise by block_k), at the blocks of the part in the fused weight. A fused checkpoint
    tensor (shard_id None on a fused layer) is split into its parts first."""
    block_n, block_k = block_size

    def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        parts = layer.output_shard_ids()
        if shard_id is None and parts != (None,):
            first_row = 0
            for part in parts:
                rows = layer.checkpoint_output_size(part)
                load(param, narrow_weight(loaded, 0, first_row // block_n, cdiv(rows, block_n)), part)
                first_row += rows
            return
        expected = (cdiv(layer.checkpoint_output_size(shard_id), block_n), cdiv(layer.checkpoint_input_size(), block_k))
        if weight_shape(loaded) != expected:
            raise ValueError(
                f"{layer.prefix or type(layer).__name__}: weight_scale_inv of shape {weight_shape(loaded)} does not "
                f"fit weight_block_size {list(block_size)} (expected {expected})"
            )
        start, offset, size = layer.output_shard(shard_id)
        col_start, cols = layer.input_shard()
        block_rows = slice(start // block_n, start // block_n + cdiv(size, block_n))
        block_cols = slice(col_start // block_k, col_start // block_k + cdiv(cols, block_k))
        target = param.data.narrow(0, offset // block_n, cdiv(size, block_n))
        copy_weight(target, loaded[block_rows, block_cols].to(torch.float32))

    return load
