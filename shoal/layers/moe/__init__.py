"""Mixture-of-experts layers: routing (`RoutingConfig`, `select_experts`), the router
(`MoEGate`), the routed experts (`FusedMoE`), shared experts (`SharedExpertMLP`,
`SharedExpertGate`), the block that combines them (`SparseMoeBlock`) and which decoder layers
have experts (`is_moe_layer`). See docs/moe.md."""

from __future__ import annotations

from shoal.layers.moe.block import SparseMoeBlock
from shoal.layers.moe.experts import (
    GATE_UP_DOWN_PROJECTIONS,
    MIXTRAL_PROJECTIONS,
    ExpertPlacement,
    FusedMoE,
    MoEMethod,
    UnquantizedMoEMethod,
    expert_checkpoint_target,
    load_expert_weights,
)
from shoal.layers.moe.gate import MoEGate
from shoal.layers.moe.routing import RoutingConfig, num_routed_experts, select_experts
from shoal.layers.moe.shared_experts import SharedExpertGate, SharedExpertMLP
from shoal.layers.moe.sparsity import is_moe_layer

__all__ = [
    "GATE_UP_DOWN_PROJECTIONS",
    "MIXTRAL_PROJECTIONS",
    "ExpertPlacement",
    "FusedMoE",
    "MoEGate",
    "MoEMethod",
    "RoutingConfig",
    "SharedExpertGate",
    "SharedExpertMLP",
    "SparseMoeBlock",
    "UnquantizedMoEMethod",
    "expert_checkpoint_target",
    "is_moe_layer",
    "load_expert_weights",
    "num_routed_experts",
    "select_experts",
]
