"""DeepSeek-V2 and V2-Lite (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model") and DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical
Report"): pre-norm decoders whose attention is multi-head latent attention (shoal/layers/mla.py)
and whose MLPs, from layer `first_k_dense_replace` on, are DeepSeekMoE blocks:

    h = x + MLA(RMSNorm(x))
    out = h + sum_{e in topk(x')} g_e * Expert_e(x') + SharedExperts(x'),   x' = RMSNorm(h)

- Routing (shoal/layers/moe/routing.py): V2 softmax scores, `greedy` or `group_limited_greedy`
  top-k; V3 sigmoid scores chosen with the `e_score_correction_bias` over the `topk_group` best
  of `n_group` groups (`noaux_tc`), renormalized; both scaled by `routed_scaling_factor`. The
  router runs in float32 whatever the model's dtype, as the reference does.
- `n_shared_experts` shared experts are one SwiGLU MLP of `n_shared_experts *
  moe_intermediate_size` every token goes through (`mlp.shared_experts`).
- The first `first_k_dense_replace` layers keep a dense MLP of `intermediate_size`.
- DeepSeek-V3 checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after
  the last decoder layer (`model.layers.61.*` in the released model): they serve speculative
  decoding, so the target skips them at load and the MTP proposer loads them
  (shoal/models/deepseek_mtp.py, shoal/spec_decode/mtp.py).

Layer structure, residual fusion and pipeline stages are Llama's (shoal/models/llama.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.mla import MLAAttention
from shoal.layers.moe import (
    GATE_UP_DOWN_PROJECTIONS,
    RoutingConfig,
    SharedExpertMLP,
    SparseMoeBlock,
    is_moe_layer,
    load_expert_weights,
)
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.rotary import RotaryEmbedding, get_rope, rope_params_from_config
from shoal.models.llama import LlamaForCausalLM
from shoal.models.utils import layer_index

logger = logging.getLogger(__name__)


class DeepseekMoE(SparseMoeBlock):
    """The routed experts plus the shared experts: experts(x) + shared_experts(x)."""

    def __init__(self, config: Any, quant_config: Fp8Config | None, prefix: str):
        super().__init__(
            config.hidden_size,
            config.moe_intermediate_size,
            RoutingConfig.from_hf_config(config),
            gate_dtype=torch.float32,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=prefix,
        )
        num_shared = int(getattr(config, "n_shared_experts", None) or 0)
        self.shared_experts = (
            SharedExpertMLP(
                config.hidden_size, num_shared * config.moe_intermediate_size, quant_config, f"{prefix}.shared_experts"
            )
            if num_shared
            else None
        )

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(hidden_states)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    attention_cls = MLAAttention

    def build_rope(self) -> RotaryEmbedding:
        """Over qk_rope_head_dim features, interleaved pairs (V3 with rope_interleave=False:
        halves); yarn when the config scales the context."""
        config = self.config
        is_neox_style = not getattr(config, "rope_interleave", True) if config.model_type == "deepseek_v3" else False
        return get_rope(
            config.qk_rope_head_dim,
            config.max_position_embeddings,
            rope_params_from_config(config),
            is_neox_style=is_neox_style,
        )

    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        if not is_moe_layer(self.config, layer_index):
            return None  # a dense MLP of intermediate_size
        return DeepseekMoE(self.config, self.quant_config, prefix)

    def attention_layers(self) -> list[Any]:
        """The MLA layers hold their latent cache themselves."""
        return [layer.self_attn for layer in self.model.layers.values()]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        decoder = self._without_next_token_layers(weights)
        dense = load_expert_weights(decoder, params, GATE_UP_DOWN_PROJECTIONS, loaded, self._on_other_stage)
        dense_loaded = super().load_weights(dense)  # the experts load as `dense` is consumed
        return loaded | dense_loaded

    def _targets(self, name: str) -> list[tuple[str, str | int | None]]:
        """MLA's projections load one to one (Llama would fuse its q_proj into a qkv_proj)."""
        if ".self_attn." in name:
            return [(name, None)]
        return super()._targets(name)

    def _without_next_token_layers(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Every tensor but those of the multi-token-prediction layers (indices past the decoder)."""
        num_layers = self.config.num_hidden_layers
        skipped: set[int] = set()
        for name, weight in weights:
            index = layer_index(name)
            if index is not None and index >= num_layers:
                skipped.add(index)
                continue
            yield name, weight
        if skipped:
            logger.info("skipped the multi-token-prediction layers %s (the MTP proposer's)", sorted(skipped))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's structure with V3's routing (chosen by the config's model_type) and its
    multi-token-prediction layers skipped (speculative decoding's `mtp` method loads them)."""
