"""Which model class serves which Hugging Face architecture name (imports no torch)."""

from __future__ import annotations

import importlib

# architecture name in config.json → (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("shoal.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("shoal.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("shoal.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("shoal.models.qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("shoal.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("shoal.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("shoal.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("shoal.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("shoal.models.deepseek", "DeepseekV3ForCausalLM"),
}
# The architectures with mixture-of-experts layers (what `enable_expert_parallel` applies to).
_MOE_ARCHITECTURES = frozenset(
    {
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
    }
)


def supported_architectures() -> set[str]:
    return set(_MODELS)


def is_moe_architecture(architecture: str) -> bool:
    return architecture in _MOE_ARCHITECTURES


def resolve_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; shoal supports {sorted(_MODELS)}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
