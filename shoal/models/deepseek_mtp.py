"""DeepSeek-V3's multi-token-prediction module (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report",
section 2.2), run as a draft model: the next-token module the checkpoint stores after the last
decoder layer (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers` of them; the
released model has one, `model.layers.61`).

At position t it combines the main model's final hidden state there with the embedding of the
token after t, runs one decoder layer of the model's own kind (MLA, and the MoE of the layers
past `first_k_dense_replace`) and predicts the token after that with the shared output head:

    x_t = eh_proj([RMSNorm_e(Emb(y_{t+1})); RMSNorm_h(h_t)])   2 * hidden -> hidden (enorm, hnorm)
    o_t = DecoderLayer(x_t)                                     the residual stream after the layer
    p(y_{t+2}) = softmax(Head(RMSNorm_s(o_t)))                  (shared_head.norm, the target's head)

The report writes the projection's input as [RMSNorm(h); RMSNorm(Emb)]; the released weights
take the embedding first, as here (what the serving engines do, and what gives the published
acceptance rates). Drafting further, o_t stands in for h at the next position, as for an EAGLE
head (shoal/models/llama_eagle3.py).

The embedding and the output head are shared with the main model (the report's "shared
embedding layer and output head"): the checkpoint's copies, `model.layers.{N}.embed_tokens` and
`model.layers.{N}.shared_head.head`, are not loaded; the target's modules serve (`tie_to_target`).
In a block-fp8 checkpoint the decoder layer's projections and experts are fp8 like the rest of
the model; `eh_proj` is stored in the model's dtype in the released checkpoint (fp8 when the
checkpoint gives it a `weight_scale_inv`).

Only the first next-token module drafts: with one KV cache written over every position of the
step, it drafts every position of the chain (a second module would see only its own drafts'
positions in its cache). DeepSeek-V3 and R1 have one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.layernorm import RMSNorm
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.mla import MLAAttention
from shoal.layers.moe import GATE_UP_DOWN_PROJECTIONS, is_moe_layer, load_expert_weights
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.rotary import RotaryEmbedding
from shoal.layers.weight_utils import default_weight_loader
from shoal.models.deepseek import DeepseekMoE
from shoal.models.llama import STACKED_PARAMS, LlamaDecoderLayer
from shoal.models.utils import layer_index

logger = logging.getLogger(__name__)

# The module's copies of the main model's embedding and head: the target's own serve instead.
_SHARED_WITH_TARGET = (".embed_tokens.", ".shared_head.head.")


def mtp_layer_index(hf_config: Any) -> int:
    """The checkpoint index of the first next-token module: the layer after the last decoder layer."""
    return int(hf_config.num_hidden_layers)


class SharedHead(nn.Module):
    """The norm before the shared output head (the head itself is the main model's)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)


class DeepseekMtpLayer(LlamaDecoderLayer):
    """One next-token module: a DeepSeek decoder layer (its `self_attn`, `mlp` and two norms under
    the checkpoint's names) with the module's input norms, projection and head norm beside them."""

    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: Fp8Config | None,
        index: int,
        eh_proj_quant_config: Fp8Config | None = None,
    ):
        prefix = f"model.layers.{index}"
        mlp = DeepseekMoE(config, quant_config, f"{prefix}.mlp") if is_moe_layer(config, index) else None
        super().__init__(config, rotary_emb, MLAAttention, quant_config, prefix, mlp)
        hidden_size, eps = int(config.hidden_size), config.rms_norm_eps
        self.enorm = RMSNorm(hidden_size, eps=eps)
        self.hnorm = RMSNorm(hidden_size, eps=eps)
        self.eh_proj = ReplicatedLinear(
            2 * hidden_size, hidden_size, bias=False, quant_config=eh_proj_quant_config, prefix=f"{prefix}.eh_proj"
        )
        self.shared_head = SharedHead(hidden_size, eps)

    def predict(self, positions: torch.Tensor, embeds: torch.Tensor, previous_hidden: torch.Tensor) -> torch.Tensor:
        """embeds (of the token after each position), previous_hidden (h_t) [num_tokens, hidden] ->
        o [num_tokens, hidden], the residual stream after the layer."""
        x = torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1)  # [num_tokens, 2 * hidden]
        x, residual = super().forward(positions, self.eh_proj(x), None)
        return x + residual


class DeepseekMTP(nn.Module):
    """The drafter the MTP proposer drives (shoal/spec_decode/mtp.py), with the EAGLE head's
    interface. Parameter names are the checkpoint's (`model.layers.{N}.*`)."""

    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        quant_config: Fp8Config | None = None,
        *,
        eh_proj_quantized: bool = False,
    ):
        """`rotary_emb`: the target's (the module's positions are the target's); `quant_config`:
        the target's fp8 scheme, for the decoder layer; `eh_proj_quantized`: the checkpoint
        stores eh_proj in fp8 too."""
        super().__init__()
        self.config = config
        self.index = mtp_layer_index(config)
        self.model = nn.Module()
        layer = DeepseekMtpLayer(
            config, rotary_emb, quant_config, self.index, quant_config if eh_proj_quantized else None
        )
        self.model.layers = nn.ModuleDict({str(self.index): layer})
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None

    @property
    def layer(self) -> DeepseekMtpLayer:
        return self.model.layers[str(self.index)]  # type: ignore[index,return-value]

    def tie_to_target(self, target_model: Any) -> None:
        """Share the target's embedding and output head (the same modules)."""
        self.embed_tokens = target_model.model.embed_tokens
        self.lm_head = target_model.lm_head

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states are the module's h as they are."""
        return hidden_states

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """input_ids (the token after each position), positions [num_tokens], h [num_tokens,
        hidden] -> o [num_tokens, hidden]."""
        assert self.embed_tokens is not None, "tie_to_target first"
        return self.layer.predict(positions, self.embed_tokens(input_ids), hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """o [num_tokens, hidden] -> logits [num_tokens, vocab_size]."""
        assert self.lm_head is not None, "tie_to_target first"
        return self.lm_head.compute_logits(self.layer.shared_head.norm(hidden_states))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def attention_layers(self) -> list[MLAAttention]:
        """The MLA layer holds its latent cache itself."""
        return [self.layer.self_attn]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load the module's tensors among `weights`, by the target checkpoint's names
        (`model.layers.{N}.*`); every other name (the main model's, another next-token module's,
        the copies of the shared embedding and head) passes silently, so the target's whole
        checkpoint, or an RL update of it, can be handed over. Returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        own = (w for w in weights if layer_index(w[0]) == self.index and not _shared_with_target(w[0]))
        others = load_expert_weights(own, params, GATE_UP_DOWN_PROJECTIONS, loaded, lambda name: False)
        for name, weight in others:
            param_name, shard_id = _target(name)
            param = params.get(param_name)
            if param is None:
                if "rotary_emb.inv_freq" not in name:
                    logger.warning("checkpoint tensor %s matches no parameter of the MTP module; skipped", name)
                continue
            loader: Any = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, weight)
            else:
                loader(param, weight, shard_id)
            loaded.add(param_name)
        return loaded


def _shared_with_target(name: str) -> bool:
    return any(part in name for part in _SHARED_WITH_TARGET)


def _target(name: str) -> tuple[str, str | int | None]:
    """MLA's projections load one to one; the dense and shared experts' gate and up projections
    into one gate_up_proj."""
    if ".self_attn." not in name:
        for fused, original, shard_id in STACKED_PARAMS:
            if original in name:
                return name.replace(original, fused), shard_id
    return name, None
