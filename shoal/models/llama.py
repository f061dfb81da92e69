"""Llama (Touvron et al., 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models"; Meta,
2024, "The Llama 3 Herd of Models") and the models that share its architecture: Mistral 7B
(Jiang et al., 2023), SmolLM2 (Allal et al., 2025). Qwen2 and Qwen3 reuse these blocks.

A decoder-only transformer with pre-normalization (RMSNorm), rotary position embeddings,
grouped-query attention and a SwiGLU MLP:

    h = x + Attention(RMSNorm(x))
    out = h + MLP(RMSNorm(h))

As in most inference engines each residual add is fused into the RMSNorm that follows it, so a
layer returns its two branches (output, residual) and the next layer's norm adds them.
Hugging Face checkpoint names map one to one onto these modules, except that q/k/v_proj are
loaded into one fused qkv_proj and gate/up_proj into one fused gate_up_proj.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shoal.distributed.parallel_state import get_pp_group, pp_layer_range
from shoal.forward_context import get_forward_context
from shoal.kernels.rope_and_cache import fused_rope_and_cache_available, rope_and_cache
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.layernorm import RMSNorm
from shoal.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.rotary import RotaryEmbedding, get_rope, rope_params_from_config
from shoal.layers.weight_utils import default_weight_loader
from shoal.models.utils import head_dim_of, layer_index, warn_if_sliding_window

logger = logging.getLogger(__name__)

IntermediateTensors = dict[str, torch.Tensor]
# (layer index, parameter prefix) -> the layer's MLP, or None for the dense one.
BuildMlp = Callable[[int, str], "nn.Module | None"]

# Checkpoint projections fused into one parameter: (fused name, checkpoint name, shard id).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer, 2020): down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up, then down: fused into one kernel at batch 1 (RowParallelLinear.forward_swiglu).
        return self.down_proj.forward_swiglu(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE; subclasses change the biases or add a q/k norm."""

    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, quant_config: Fp8Config | None = None, prefix: str = ""
    ):
        super().__init__()
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self.biases(config)
        self.qkv_proj = QKVParallelLinear(
            self.input_size(config),
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5, self.qkv_proj.num_kv_heads)

    @staticmethod
    def input_size(config: Any) -> int:
        """Features of the attention's input (an EAGLE-3 head's layer reads two hidden states)."""
        return int(config.hidden_size)

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        """(q/k/v projections have a bias, output projection has a bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def qk_norm_params(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q_norm weight, k_norm weight, eps) when `normalize_qk` is a per-head RMSNorm, for the
        fused kernel; None when q and k are not normalized."""
        return None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views, [num_tokens, *_size]
        if self._try_fused_rope_and_cache(positions, qkv):
            return self.o_proj(self.attn(q, k, v, kv_cached=True))
        q, k = self.rotary_emb(positions, *self.normalize_qk(q, k))
        return self.o_proj(self.attn(q, k, v))

    def _try_fused_rope_and_cache(self, positions: torch.Tensor, qkv: torch.Tensor) -> bool:
        """On CUDA in float16/bfloat16 with a bound cache: q/k norm, rotary and the cache write as
        one kernel, in place in qkv (at decode the separate launches cost more than their work).
        False, having done nothing, on CPU, in float32 (kept bit-identical with Hugging Face) and
        in runs without attention metadata."""
        if not fused_rope_and_cache_available(qkv):
            return False
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata is None or self.attn.kv_cache is None:
            return False
        q_norm_weight, k_norm_weight, eps = self.qk_norm_params() or (None, None, 1e-6)
        rope_and_cache(
            positions, qkv, self.attn.kv_cache, attn_metadata.slot_mapping, self.rotary_emb.cos_sin_cache,
            self.attn.num_heads, self.attn.num_kv_heads, self.head_dim, self.rotary_emb.is_neox_style,
            q_norm_weight, k_norm_weight, eps,
        )  # fmt: skip
        return True


def _add_and_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); the first layer has no residual yet, only x."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
        quant_config: Fp8Config | None = None,
        prefix: str = "",
        mlp: nn.Module | None = None,
    ):
        """`mlp`: the layer's MLP when it is not the dense SwiGLU one (a mixture of experts)."""
        super().__init__()
        self.self_attn = attention_cls(config, rotary_emb, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = mlp if mlp is not None else self._dense_mlp(config, quant_config, prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @staticmethod
    def _dense_mlp(config: Any, quant_config: Fp8Config | None, prefix: str) -> LlamaMLP:
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        return LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            mlp_bias,
            config.hidden_act,
            quant_config,
            prefix=f"{prefix}.mlp",
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = _add_and_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, this pipeline stage's decoder layers, final norm.

    Layers are kept in a ModuleDict keyed by their global index, so parameter names are the
    checkpoint's names on every stage ("model.layers.17.mlp...").
    """

    def __init__(
        self,
        config: Any,
        attention_cls: type[LlamaAttention],
        pipeline_layer_partition: tuple[int, ...] | None = None,
        quant_config: Fp8Config | None = None,
        build_mlp: BuildMlp | None = None,
        rotary_emb: RotaryEmbedding | None = None,
    ):
        """`build_mlp(layer_index, prefix)`: a layer's MLP, or None for the dense one;
        `rotary_emb`: the rotary embedding when it is not the config's neox-style one."""
        super().__init__()
        warn_if_sliding_window(config)
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(
            config.num_hidden_layers, pp.rank_in_group, pp.world_size, pipeline_layer_partition
        )
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache shared by every layer (it can be large: max_position x head_dim).
        self.rotary_emb = rotary_emb or get_rope(
            head_dim_of(config), config.max_position_embeddings, rope_params_from_config(config)
        )
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(
                    config,
                    self.rotary_emb,
                    attention_cls,
                    quant_config,
                    f"model.layers.{i}",
                    build_mlp(i, f"model.layers.{i}.mlp") if build_mlp is not None else None,
                )
                for i in range(self.start_layer, self.end_layer)
            }
        )
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Off by default: the layers whose input the forward returns beside its output, for an
        # EAGLE-3 head (see LlamaForCausalLM.set_aux_hidden_state_layers).
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden_size]
        else:
            assert intermediate_tensors is not None, "a later pipeline stage needs the previous stage's tensors"
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        aux: list[torch.Tensor] = []
        for index, layer in self.layers.items():
            if int(index) in self.aux_hidden_state_layers:
                aux.append(_residual_stream(hidden_states, residual))
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.is_last_stage:
            return {"hidden_states": hidden_states, "residual": residual}
        if self.end_layer in self.aux_hidden_state_layers:
            aux.append(_residual_stream(hidden_states, residual))
        hidden_states, _ = _add_and_norm(self.norm, hidden_states, residual)
        if aux:
            return hidden_states, torch.cat(aux, dim=-1)  # [num_tokens, hidden_size], [.., len(aux) * hidden_size]
        return hidden_states  # [num_tokens, hidden_size]


def _residual_stream(hidden_states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream between two layers (the two branches a layer hands the next, summed),
    as a new tensor: the layers' norms add them in place later. Before the first layer: the
    embeddings (copied, since the first layer keeps them as its residual)."""
    return hidden_states.clone() if residual is None else hidden_states + residual


class LlamaForCausalLM(nn.Module):
    """The model runner's interface: forward, compute_logits, load_weights, attention_layers.

    With `quant_config` the decoder's linear layers are fp8; the embedding, the norms and the
    LM head stay in the model's dtype."""

    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(
        self,
        hf_config: Any,
        quant_config: Fp8Config | None = None,
        *,
        pipeline_layer_partition: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.config = hf_config
        self.quant_config = quant_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(
            hf_config, self.attention_cls, pipeline_layer_partition, quant_config, self.build_mlp, self.build_rope()
        )
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.tie_weights(self.model.embed_tokens)

    def build_mlp(self, layer_index: int, prefix: str) -> nn.Module | None:
        """The MLP of decoder layer `layer_index` (parameter prefix `prefix`); None: the dense
        SwiGLU MLP. Mixture-of-experts models return their expert block for their MoE layers."""
        return None

    def build_rope(self) -> RotaryEmbedding | None:
        """The rotary embedding every layer shares; None: the config's, neox style."""
        return None

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """From now on the forward also returns the residual stream entering each of `layers`
        (0: the embeddings; num_hidden_layers: the last layer's output, before the final norm),
        concatenated in layer order: (hidden_states [num_tokens, hidden_size], aux [num_tokens,
        len(layers) * hidden_size]). An EAGLE-3 head fuses these low, middle and high features;
        `()` turns it off. One pipeline stage must hold all of them."""
        num_layers = int(self.config.num_hidden_layers)
        layers = tuple(sorted(set(int(i) for i in layers)))
        if any(not 0 <= i <= num_layers for i in layers):
            raise ValueError(f"auxiliary hidden-state layers {list(layers)} must lie in [0, {num_layers}]")
        model = self.model
        if layers and not (model.is_first_stage and model.is_last_stage):
            raise ValueError("auxiliary hidden states (EAGLE-3) need the whole model on one pipeline stage")
        model.aux_hidden_state_layers = layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size] on the last
        pipeline stage (with the auxiliary hidden states after them when some are set:
        `set_aux_hidden_state_layers`), else {"hidden_states", "residual"} for the next stage."""
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden_size] -> logits [num_tokens, vocab_size]."""
        return self.lm_head.compute_logits(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers in layer order, for the runner to bind `kv_cache`."""
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load Hugging Face (name, tensor) pairs; returns the names of the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            for param_name, shard_id in self._targets(name):
                if param_name not in params:
                    if not self._on_other_stage(name):
                        logger.warning("checkpoint tensor %s matches no parameter; skipped", name)
                    continue
                param = params[param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                if shard_id is None:
                    loader(param, weight)
                else:
                    loader(param, weight, shard_id)
                loaded.add(param_name)
        return loaded

    def _targets(self, name: str) -> list[tuple[str, str | int | None]]:
        """The (parameter name, shard id) pairs a checkpoint tensor is loaded into."""
        if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return []
        if self.tie_word_embeddings and name == "model.embed_tokens.weight":
            # When embedding and head live on different stages, the head loads its own copy.
            head_has_own_copy = self.model.is_last_stage and not self.model.is_first_stage
            return [(name, None)] + ([("lm_head.weight", None)] if head_has_own_copy else [])
        for fused, original, shard_id in STACKED_PARAMS:
            if original in name:
                return [(name.replace(original, fused), shard_id)]
        return [(name, None)]

    def _on_other_stage(self, name: str) -> bool:
        index = layer_index(name)
        if index is not None:
            return not self.model.start_layer <= index < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return not self.model.is_first_stage
        if name.startswith(("model.norm.", "lm_head.")):
            return not self.model.is_last_stage
        return False
