"""The router of a mixture-of-experts layer: one logit per expert, then the family's top-k rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.moe.routing import RoutingConfig, select_experts
from shoal.layers.weight_utils import default_weight_loader


def _replicated_parameter(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class MoEGate(nn.Module):
    """logits = x W^T with W [num_experts, hidden_size], whole on every tensor-parallel rank (the
    activations are replicated, so every rank routes every token the same way); `forward`
    returns `select_experts`' (topk_weights, topk_ids).

    `params_dtype` float32 keeps W (and DeepSeek-V3's `e_score_correction_bias`) in float32 and
    the logits computed in float32, as DeepSeek's reference does: in bfloat16 two experts' logits
    that differ in the last bits may swap places in the top-k. None: the model's dtype (Mixtral,
    Qwen, whose references compute the logits in the model's dtype)."""

    def __init__(self, hidden_size: int, routing: RoutingConfig, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.routing = routing
        self.weight = _replicated_parameter(routing.num_experts, hidden_size, dtype=params_dtype)
        self.e_score_correction_bias = (
            _replicated_parameter(routing.num_experts, dtype=params_dtype) if routing.uses_correction_bias else None
        )

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden_size] -> [num_tokens, num_experts]."""
        return F.linear(hidden_states.to(self.weight.dtype), self.weight)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (topk_weights float32 [num_tokens, top_k], topk_ids int64 [num_tokens, top_k])."""
        return select_experts(self.router_logits(hidden_states), self.routing, self.e_score_correction_bias)

    def extra_repr(self) -> str:
        r = self.routing
        return (
            f"experts={r.num_experts}, top_k={r.top_k}, {r.scoring_func}, {r.topk_method}, renormalize={r.renormalize}"
        )
