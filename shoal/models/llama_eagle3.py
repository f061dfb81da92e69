"""The EAGLE-3 draft head of a Llama-family target (Li et al., 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test"), in the layout of the published
heads (the EAGLE-3 head of Llama-3.1-8B-Instruct: config.json `"architectures":
["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size: 32000`).

The head is one Llama decoder layer that reads, at position t, the target's features there and
the embedding of the token after t, and predicts the token after that:

    g_t = fc([l_t; m_t; h_t])                           fc: 3 * target_hidden -> hidden; l, m, h: the
                                                        residual stream entering three target layers
                                                        (low, middle, high: 2, L/2, L-3 by default)
    x_t = [RMSNorm_in(Emb(y_{t+1})); RMSNorm_hid(g_t)]  2 * hidden (input_layernorm, hidden_norm)
    a_t = g_t + Attention(x_t)                          q, k, v read 2 * hidden; o writes hidden
    o_t = a_t + MLP(RMSNorm_post(a_t))
    p(y_{t+2}) = softmax(lm_head(RMSNorm(o_t)))         over the draft vocabulary

To draft further ("training-time test") the head's own o_t stands in for the features of the
next position, which the target has not computed: g_{t+1} := o_t, so a chain of k drafts is one
pass over the step's tokens and k - 1 single-token passes. The draft vocabulary (the most
frequent target tokens) maps onto the target's through `d2t`: target id = d + d2t[d].

Checkpoint names: `fc.weight`; `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight`; `midlayer.self_attn.{q,k,v,o}_proj.weight` (q, k and v
[heads * head_dim, 2 * hidden], loaded into one fused qkv_proj); `midlayer.mlp.{gate,up,
down}_proj.weight`; `norm.weight`; `lm_head.weight` [draft_vocab_size, hidden]; `d2t`
[draft_vocab_size] int64; `t2d` [vocab_size] bool (which target ids the draft vocabulary holds:
not needed to draft). A head without `embed_tokens.weight` (the Llama-3.1-8B one) embeds with
the target's embedding, and one without `lm_head.weight` (a full-vocabulary head) predicts with
the target's LM head: `tie_to_target`. Heads trained with `norm_before_residual` (a config key)
keep RMSNorm_hid(g_t) rather than g_t as the attention's residual.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.layernorm import RMSNorm
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.rotary import RotaryEmbedding, get_rope, rope_params_from_config
from shoal.layers.weight_utils import default_weight_loader, full_weight
from shoal.models.llama import STACKED_PARAMS, LlamaAttention, LlamaDecoderLayer
from shoal.models.utils import head_dim_of

logger = logging.getLogger(__name__)

# Checkpoint tensors the head does not read: which target ids the draft vocabulary holds (`d2t`
# says where each draft id goes, which is all drafting needs).
_UNUSED_TENSORS = ("t2d",)


def eagle3_aux_layers(head_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head fuses: the config's
    `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`) when set, else the
    published heads' low, middle and high choice (2, L // 2, L - 3)."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(head_config, "eagle_config", None)
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        return tuple(int(i) for i in ids)
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Attention(LlamaAttention):
    """Llama's attention over the concatenated embedding and features (2 * hidden_size)."""

    @staticmethod
    def input_size(config: Any) -> int:
        return 2 * int(config.hidden_size)


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The head's decoder layer (`midlayer`): Llama's, with `hidden_norm` beside
    `input_layernorm` and an attention that reads both normalized inputs side by side."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str = "midlayer"):
        super().__init__(config, rotary_emb, Eagle3Attention, prefix=prefix)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden_states [num_tokens, hidden_size] -> (MLP output, residual), whose sum is
        the layer's output."""
        normed_hidden = self.hidden_norm(hidden_states)
        # A copy: the post-attention norm adds into its residual in place.
        residual = normed_hidden if self.norm_before_residual else hidden_states.clone()
        x = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)  # [num_tokens, 2 * hidden_size]
        x = self.self_attn(positions, x)  # [num_tokens, hidden_size]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """The head, with the drafter interface the EAGLE proposer drives (shoal/spec_decode/eagle.py):
    `combine_hidden_states`, `forward`, `compute_logits`, `to_target_ids`, `attention_layers`,
    `load_weights`, `tie_to_target`."""

    def __init__(self, config: Any, *, has_embedding: bool, has_lm_head: bool, max_position: int):
        """`has_embedding` / `has_lm_head`: the checkpoint holds them (else the target's serve);
        `max_position`: positions the rotary embedding covers (the target's context, which the
        published heads' `max_position_embeddings` understates)."""
        super().__init__()
        self.config = config
        hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or self.vocab_size)
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or hidden_size)
        self.fc = ReplicatedLinear(3 * self.target_hidden_size, hidden_size, bias=False, prefix="fc")
        self.rotary_emb = get_rope(head_dim_of(config), max_position, rope_params_from_config(config))
        self.midlayer = Eagle3DecoderLayer(config, self.rotary_emb)
        self.norm = RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, hidden_size) if has_embedding else None
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden_size) if has_lm_head else None
        # Draft id d is target id d + d2t[d] (zeros: the same vocabulary).
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)

    def tie_to_target(self, target_model: Any) -> None:
        """Embed with the target's embedding and predict with its LM head where the checkpoint has
        none of its own: the same modules, so a weight update of the target reaches the head."""
        if self.embed_tokens is None:
            self.embed_tokens = target_model.model.embed_tokens
        if self.lm_head is None:
            if self.draft_vocab_size != self.vocab_size:
                raise ValueError(
                    f"the EAGLE-3 head drafts from {self.draft_vocab_size} tokens but has no lm_head.weight of its own"
                )
            self.lm_head = target_model.lm_head

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's three layers' features [num_tokens, 3 * target_hidden] -> g [num_tokens, hidden]."""
        return self.fc(aux_hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids (the token after each position), positions [num_tokens], hidden_states g
        [num_tokens, hidden] -> o [num_tokens, hidden] (before the final norm: fed back as the next
        position's g, and to `compute_logits`)."""
        assert self.embed_tokens is not None, "tie_to_target first"
        x, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden_states)
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """o [num_tokens, hidden] -> logits over the draft vocabulary [num_tokens, draft_vocab_size]."""
        assert self.lm_head is not None, "tie_to_target first"
        return self.lm_head.compute_logits(self.norm(hidden_states))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's ids."""
        return draft_ids + self.d2t[draft_ids]

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load the head's checkpoint names (see the module docstring); names of the target's
        (an RL update of the target) are not the head's and pass silently: the tied embedding
        and LM head are the target's own modules. Returns the names of what was loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            if name == "d2t":
                self.d2t.copy_(full_weight(weight).to(torch.int64))
                loaded.add(name)
                continue
            if name in _UNUSED_TENSORS or "rotary_emb.inv_freq" in name:
                continue
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


def fused_param_name(name: str) -> tuple[str, str | int | None]:
    """The parameter a checkpoint tensor loads into: q/k/v into qkv_proj, gate/up into gate_up_proj."""
    for fused, original, shard_id in STACKED_PARAMS:
        if original in name:
            return name.replace(original, fused), shard_id
    return name, None
