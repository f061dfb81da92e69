"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): the Mistral 7B architecture with every
MLP replaced by a sparse mixture of experts: eight SwiGLU experts per layer, each token routed
to the two with the largest router logits, their outputs weighted by the softmax of those two
logits (a softmax over all experts, renormalized over the top two):

    h = x + Attention(RMSNorm(x))
    out = h + sum_{e in top2(router(x'))} softmax(...)_e * Expert_e(x'),   x' = RMSNorm(h)

The checkpoint names the expert block `block_sparse_moe` (`.gate`, `.experts.{e}.w1/w2/w3` with
w1 the gate projection, w3 the up projection, w2 the down projection); transformers 5 keeps it
as `mlp` in memory and writes stacked `mlp.experts.gate_up_proj` / `down_proj` with
`save_pretrained(save_original_format=False)`. Both load, into the block at `mlp`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from shoal.layers.moe import MIXTRAL_PROJECTIONS, RoutingConfig, SparseMoeBlock, load_expert_weights
from shoal.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module:
        config = self.config
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            RoutingConfig.from_hf_config(config),
            hidden_act=config.hidden_act,
            quant_config=self.quant_config,
            prefix=prefix,
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), weight) for name, weight in weights)
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        dense = load_expert_weights(renamed, params, MIXTRAL_PROJECTIONS, loaded, self._on_other_stage)
        dense_loaded = super().load_weights(dense)  # the experts load as `dense` is consumed
        return loaded | dense_loaded
