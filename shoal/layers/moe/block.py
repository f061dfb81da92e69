"""`SparseMoeBlock`: the MLP of a mixture-of-experts decoder layer: route, run the chosen
experts, add the shared experts' output if the family has any, all-reduce once.

    topk_weights, topk_ids = gate(x)
    out = experts(x, topk_weights, topk_ids) [+ shared_output(x)]

Parameter names follow the checkpoints: `gate` (the router), `experts` (`FusedMoE`); a family
with shared experts subclasses the block, builds them from `SharedExpertMLP` (and
`SharedExpertGate`) under its checkpoint's names and overrides `shared_output`.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.distributed.parallel_state import get_tp_group
from shoal.layers.moe.experts import FusedMoE
from shoal.layers.moe.gate import MoEGate
from shoal.layers.moe.routing import RoutingConfig
from shoal.layers.quantization.fp8_config import Fp8Config


class SparseMoeBlock(nn.Module):
    """Router and routed experts; `shared_output` adds nothing unless a subclass says so."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        routing: RoutingConfig,
        *,
        expert_parallel: bool | None = None,
        gate_dtype: torch.dtype | None = None,
        hidden_act: str = "silu",
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.gate = MoEGate(hidden_size, routing, params_dtype=gate_dtype)
        self.experts = FusedMoE(
            routing.num_experts,
            routing.top_k,
            hidden_size,
            moe_intermediate_size,
            expert_parallel=expert_parallel,
            hidden_act=hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial sum of the shared experts' output; None when there are none."""
        return None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        topk_weights, topk_ids = self.gate(hidden_states)
        out = self.experts(hidden_states, topk_weights, topk_ids)  # partial sum over the TP ranks
        shared = self.shared_output(hidden_states)
        if shared is not None:
            out = out + shared
        return get_tp_group().all_reduce(out)
