"""Shared experts: an MLP that every token of a MoE layer goes through, beside its routed experts
(Dai et al., 2024, "DeepSeekMoE", section 3.2: "shared expert isolation").

DeepSeek-V2/V3 add `n_shared_experts` of them, which are one SwiGLU MLP of
`n_shared_experts * moe_intermediate_size`; Qwen2-MoE has one of `shared_expert_intermediate_size`
scaled per token by sigmoid(x w_gate) (`shared_expert_gate`, [1, hidden]).

The down projection leaves its partial sum unreduced: the MoE block adds it to the routed
experts' partial sum and all-reduces once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.weight_utils import new_parameter


class SharedExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate/up column-parallel (one matmul), down row-parallel with
    its all-reduce left to the caller. Parameter names are the checkpoint's (`gate_proj` and
    `up_proj` load into `gate_up_proj` with shard ids 0 and 1, as in the dense models)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, quant_config: Fp8Config | None = None, prefix: str = ""
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            reduce_results=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> this rank's partial sum [num_tokens, hidden_size]."""
        return self.down_proj.forward_swiglu(self.gate_up_proj(x))


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's per-token scale of the shared expert: sigmoid(x w^T), w [1, hidden_size],
    whole on every rank (the scale multiplies each rank's partial sum alike). Kept in float,
    like the router, whatever the linear layers' quantization."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = new_parameter(1, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, 1]."""
        return torch.sigmoid(F.linear(x, self.weight))
