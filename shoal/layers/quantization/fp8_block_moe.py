"""Block-wise fp8 routed experts (DeepSeek-V3's checkpoints): the `MoEMethod` of a `FusedMoE`
(shoal/layers/moe/experts.py) whose experts are stored as

    w13_weight            float8_e4m3fn [num_local_experts, 2 * I_rank, hidden]
    w13_weight_scale_inv  float32       [num_local_experts, 2 * I_rank / block_n, ceil(hidden / block_k)]
    w2_weight             float8_e4m3fn [num_local_experts, hidden, I_rank]
    w2_weight_scale_inv   float32       [num_local_experts, ceil(hidden / block_n), ceil(I_rank / block_k)]

loaded from each expert's `gate_proj/up_proj/down_proj.weight` and `.weight_scale_inv` (or the
stacked tensors) by the layer's loaders: the scales take the same experts and the same cut of
the intermediate dimension as the weights, counted in blocks. So gate and up, fused along w13's
rows, must each hold whole blocks of block_n rows, and a tensor-parallel cut of the intermediate
dimension must fall on block boundaries of both block_n (w13's rows) and block_k (w2's
columns); expert parallelism keeps experts whole and needs only the former.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.distributed.parallel_state import get_tp_group
from shoal.kernels.fused_moe_block_fp8 import fused_moe_block_fp8, warm_up_fused_moe_block_fp8
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE
from shoal.layers.quantization.fp8_block import cdiv, check_block_aligned
from shoal.layers.quantization.fp8_config import Fp8Config


def _parameter(data: torch.Tensor, weight_loader: Any) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


class Fp8BlockMoEMethod:
    """Block-wise fp8 experts, applied with `fused_moe_block_fp8` (see the module docstring)."""

    def __init__(self, config: Fp8Config, prefix: str = ""):
        if config.weight_block_size is None:
            raise ValueError("Fp8BlockMoEMethod needs a weight_block_size")
        self.block_size: tuple[int, int] = config.weight_block_size
        self.prefix = prefix
        # The model's dtype (the loader builds the model under it): the activations' dtype.
        self.activation_dtype = torch.get_default_dtype()

    def create_weights(self, layer: Any) -> None:
        block_n, block_k = self.block_size
        self._check_layout(layer)
        p = layer.placement
        experts, rows, hidden = p.num_local_experts, p.intermediate_per_rank, layer.hidden_size
        layer.w13_weight = _parameter(torch.empty(experts, 2 * rows, hidden, dtype=FP8_DTYPE), layer.weight_loader)
        layer.w2_weight = _parameter(torch.empty(experts, hidden, rows, dtype=FP8_DTYPE), layer.weight_loader)
        scale_loader = layer.block_scale_loader(block_n, block_k)
        w13_scales = torch.empty(experts, 2 * (rows // block_n), cdiv(hidden, block_k), dtype=torch.float32)
        w2_scales = torch.empty(experts, cdiv(hidden, block_n), cdiv(rows, block_k), dtype=torch.float32)
        layer.w13_weight_scale_inv = _parameter(w13_scales, scale_loader)
        layer.w2_weight_scale_inv = _parameter(w2_scales, scale_loader)

    def _check_layout(self, layer: Any) -> None:
        block_n, block_k = self.block_size
        p, tp_size = layer.placement, get_tp_group().world_size
        name = self.prefix or "experts"
        start, rows = p.intermediate_start, p.intermediate_per_rank
        if start % block_n or rows % block_n:  # gate's last block would hold rows of up
            raise ValueError(
                f"{name}: the gate/up rows [{start}, {start + rows}) of the intermediate size {p.intermediate_size} "
                f"are not whole blocks of {block_n} (weight_block_size) at tensor-parallel size {tp_size}"
            )
        check_block_aligned(f"{name} down_proj columns", start, rows, p.intermediate_size, block_k, tp_size)

    def process_weights_after_loading(self, layer: Any) -> None:
        return None

    def apply(
        self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe_block_fp8(
            hidden_states,
            layer.w13_weight,
            layer.w2_weight,
            layer.w13_weight_scale_inv,
            layer.w2_weight_scale_inv,
            topk_weights,
            topk_ids,
            self.block_size,
            layer.expert_map,
        )

    def warm_up_kernels(self, layer: Any, max_num_tokens: int) -> None:
        warm_up_fused_moe_block_fp8(
            layer.w13_weight,
            layer.w2_weight,
            layer.w13_weight_scale_inv,
            layer.w2_weight_scale_inv,
            self.block_size,
            layer.top_k,
            max_num_tokens,
            self.activation_dtype,
            layer.expert_map,
        )
