"""Qwen2-MoE (Qwen Team, 2024, "Qwen1.5-MoE: Matching 7B Model Performance with 1/3 Activated
Parameters"; Yang et al., 2024, "Qwen2 Technical Report", section 2.2.2) and Qwen3-MoE (Yang et
al., 2025, "Qwen3 Technical Report"): the Qwen2 / Qwen3 decoders with mixture-of-experts MLPs.

- Routing: softmax over the experts, the top `num_experts_per_tok`, renormalized only with
  `norm_topk_prob` (Qwen2-MoE checkpoints leave them unnormalized, Qwen3-MoE normalize).
- Qwen2-MoE adds a shared expert every token goes through, scaled per token by
  sigmoid(x w_gate) (`shared_expert`, `shared_expert_gate`); Qwen3-MoE has none.
- A layer has experts unless it is in `mlp_only_layers`, every `decoder_sparse_step`-th layer;
  the others keep a dense MLP of `intermediate_size` (`is_moe_layer`).
- Attention is Qwen2's (QKV bias, `qkv_bias`) or Qwen3's (QK-norm).

Expert tensors are `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` in the published
checkpoints, or stacked `mlp.experts.gate_up_proj` / `down_proj` (transformers 5's in-memory
layout, `save_pretrained(save_original_format=False)`); both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.moe import (
    GATE_UP_DOWN_PROJECTIONS,
    RoutingConfig,
    SharedExpertGate,
    SharedExpertMLP,
    SparseMoeBlock,
    is_moe_layer,
    load_expert_weights,
)
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.models.llama import LlamaAttention, LlamaForCausalLM
from shoal.models.qwen3 import Qwen3Attention


class Qwen2MoeAttention(LlamaAttention):
    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """The routed experts plus the gated shared expert: experts(x) + sigmoid(x w_gate) * shared(x)."""

    def __init__(self, config: Any, quant_config: Fp8Config | None, prefix: str):
        super().__init__(
            config.hidden_size,
            config.moe_intermediate_size,
            RoutingConfig.from_hf_config(config),
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=prefix,
        )
        shared_size = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = (
            SharedExpertMLP(config.hidden_size, shared_size, quant_config, f"{prefix}.shared_expert")
            if shared_size
            else None
        )
        self.shared_expert_gate = SharedExpertGate(config.hidden_size) if shared_size else None

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None or self.shared_expert_gate is None:
            return None
        return self.shared_expert_gate(hidden_states) * self.shared_expert(hidden_states)


class _QwenMoeForCausalLM(LlamaForCausalLM):
    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        if not is_moe_layer(self.config, layer_index):
            return None  # a dense MLP of intermediate_size
        return Qwen2MoeSparseMoeBlock(self.config, self.quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        dense = load_expert_weights(weights, params, GATE_UP_DOWN_PROJECTIONS, loaded, self._on_other_stage)
        dense_loaded = super().load_weights(dense)  # the experts load as `dense` is consumed
        return loaded | dense_loaded


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    attention_cls = Qwen2MoeAttention


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    attention_cls = Qwen3Attention
