"""The EAGLE draft head of a Llama-family target (Li et al., 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty"), in the layout of the published heads (e.g. the EAGLE
head of Llama-3-8B-Instruct: config.json of a one-layer `LlamaForCausalLM`).

EAGLE extrapolates the target's top-layer features: at position t it fuses the target's final
hidden state there with the embedding of the token after t, runs Llama decoder layers, and
reads the result with the target's own LM head:

    x_t = fc([Emb(y_{t+1}); f_t])               2 * hidden -> hidden (with a bias in some heads)
    o_t = DecoderLayers(x_t)                    the first layer without its input norm
    p(y_{t+2}) = softmax(LMHead_target(o_t))    o_t predicts the target's next (normed) feature

Drafting further, o_t stands in for f at the next position, as for an EAGLE-3 head
(shoal/models/llama_eagle3.py), so the EAGLE proposer drives both.

Checkpoint names: `fc.weight` [hidden, 2 * hidden] (and `fc.bias` where the head has one);
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.input_layernorm.weight` for i > 0;
`embed_tokens.weight` where the head has its own copy (else the target's serves). The LM head is
always the target's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.attention import Attention
from shoal.layers.embedding import VocabParallelEmbedding
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.rotary import get_rope, rope_params_from_config
from shoal.layers.weight_utils import default_weight_loader
from shoal.models.llama import LlamaAttention, LlamaDecoderLayer
from shoal.models.llama_eagle3 import fused_param_name
from shoal.models.utils import head_dim_of


class EagleLlamaForCausalLM(nn.Module):
    """The head, with the drafter interface of the EAGLE proposer (shoal/spec_decode/eagle.py)."""

    def __init__(self, config: Any, *, has_embedding: bool, fc_bias: bool, max_position: int):
        super().__init__()
        self.config = config
        hidden_size = int(config.hidden_size)
        self.fc = ReplicatedLinear(2 * hidden_size, hidden_size, bias=fc_bias, prefix="fc")
        self.rotary_emb = get_rope(head_dim_of(config), max_position, rope_params_from_config(config))
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(config, self.rotary_emb, LlamaAttention, prefix=f"layers.{i}")
                for i in range(int(config.num_hidden_layers))
            ]
        )
        # The first layer reads fc's output as it is (EAGLE's design: fc's output is already a feature).
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = VocabParallelEmbedding(int(config.vocab_size), hidden_size) if has_embedding else None
        self.lm_head: nn.Module | None = None

    def tie_to_target(self, target_model: Any) -> None:
        """The target's LM head, and its embedding where the head has none."""
        if self.embed_tokens is None:
            self.embed_tokens = target_model.model.embed_tokens
        self.lm_head = target_model.lm_head

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states are the head's features as they are."""
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids (the token after each position), positions [num_tokens], f [num_tokens,
        hidden] -> o [num_tokens, hidden]."""
        assert self.embed_tokens is not None, "tie_to_target first"
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "tie_to_target first"
        return self.lm_head.compute_logits(hidden_states)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load the head's checkpoint names; any other name (the target's) passes silently."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            param_name, shard_id = fused_param_name(name)
            param = params.get(param_name)
            if param is None:
                continue
            loader: Any = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, weight)
            else:
                loader(param, weight, shard_id)
            loaded.add(param_name)
        return loaded
