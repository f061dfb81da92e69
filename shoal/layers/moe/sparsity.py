"""Which decoder layers of a mixture-of-experts model have experts, by each family's config keys."""

from __future__ import annotations

from typing import Any

from shoal.layers.moe.routing import num_routed_experts


def is_moe_layer(hf_config: Any, layer_index: int) -> bool:
    """Whether decoder layer `layer_index` (from 0) has routed experts rather than a dense MLP.

    - Mixtral: every layer.
    - Qwen2-MoE / Qwen3-MoE: not in `mlp_only_layers`, and every `decoder_sparse_step`-th layer
      (layer i when (i + 1) % step == 0).
    - DeepSeek-V2/V3: from `first_k_dense_replace` on, every `moe_layer_freq`-th layer (layer i
      when i % freq == 0; every released checkpoint has freq 1).
    A family's keys are absent from the others' configs, so one rule serves all."""
    if num_routed_experts(hf_config) == 0:
        return False
    if layer_index in (getattr(hf_config, "mlp_only_layers", None) or ()):
        return False
    sparse_step = int(getattr(hf_config, "decoder_sparse_step", None) or 1)
    first_moe = int(getattr(hf_config, "first_k_dense_replace", None) or 0)
    moe_layer_freq = int(getattr(hf_config, "moe_layer_freq", None) or 1)
    return (layer_index + 1) % sparse_step == 0 and layer_index >= first_moe and layer_index % moe_layer_freq == 0
