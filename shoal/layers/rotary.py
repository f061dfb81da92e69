"""Rotary position embedding (Su et al., 2021, "RoFormer"), with the frequency scalings that
Llama-family checkpoints use: linear position interpolation (Chen et al., 2023, "Extending
Context Window of Large Language Models via Positional Interpolation") and Llama 3.1's
wavelength-dependent scaling (Meta, 2024, "The Llama 3 Herd of Models"; reference code in
meta-llama/llama-models `apply_scaling`).

cos and sin are precomputed for every position up to `max_position` into one `cos_sin_cache`
[max_position, rotary_dim] (cos then sin), the layout the rotary kernel reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.kernels.rotary_embedding import rotary_embedding

logger = logging.getLogger(__name__)


def rope_params_from_config(hf_config: Any) -> dict[str, Any]:
    """RoPE parameters as one flat dict with at least `rope_type` and `rope_theta`.

    Reads transformers v5's `config.rope_parameters` and, for older configs, the top-level
    `rope_theta` plus the `rope_scaling` dict (whose type key was once `type`).
    """
    params: dict[str, Any] = {}
    rope_parameters = getattr(hf_config, "rope_parameters", None)
    if isinstance(rope_parameters, dict) and rope_parameters:
        if all(isinstance(v, dict) for v in rope_parameters.values()):
            raise NotImplementedError(f"per-layer-type RoPE parameters are not supported: {rope_parameters}")
        params.update(rope_parameters)
    rope_scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(rope_scaling, dict):
        for key, value in rope_scaling.items():
            params.setdefault(key, value)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.pop("type", None)
    if "partial_rotary_factor" not in params and getattr(hf_config, "partial_rotary_factor", None):
        params["partial_rotary_factor"] = hf_config.partial_rotary_factor
    return params


def _default_inv_freq(params: dict[str, Any], rotary_dim: int, max_position: int) -> torch.Tensor:
    """inv_freq_i = theta^(-2i / d), the frequency of feature pair i."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (float(params["rope_theta"]) ** exponents)


def _linear_inv_freq(params: dict[str, Any], rotary_dim: int, max_position: int) -> torch.Tensor:
    """Position interpolation: positions divided by `factor`, i.e. every frequency divided."""
    return _default_inv_freq(params, rotary_dim, max_position) / float(params["factor"])


def _llama3_inv_freq(params: dict[str, Any], rotary_dim: int, max_position: int) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original_context / low_freq_factor are divided by
    `factor`, those shorter than original_context / high_freq_factor kept, and those between
    interpolated smoothly in original_context / wavelength."""
    inv_freq = _default_inv_freq(params, rotary_dim, max_position)
    factor = float(params["factor"])
    low_freq_factor, high_freq_factor = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original_context = float(params.get("original_max_position_embeddings") or max_position)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original_context / high_freq_factor) & (wavelen <= original_context / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


_INV_FREQ: dict[str, Callable[[dict[str, Any], int, int], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


class RotaryEmbedding(nn.Module):
    """Applies RoPE in place to the query and key of a flat batch, indexed by position."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, inv_freq: torch.Tensor, is_neox_style: bool):
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # [max_position, rotary_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]
        # Not a parameter and not saved: derived from the config, like HF's inv_freq.
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_dtype()), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [num_tokens, num_heads * head_size], key [num_tokens, num_kv_heads * head_size],
        rotated in place and returned."""
        rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)
        return query, key

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(
    head_size: int, max_position: int, rope_params: dict[str, Any], is_neox_style: bool = True
) -> RotaryEmbedding:
    """The RotaryEmbedding for `rope_params` (as returned by `rope_params_from_config`)."""
    rope_type = rope_params.get("rope_type", "default")
    if rope_type not in _INV_FREQ:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported; shoal supports {sorted(_INV_FREQ)}")
    rotary_dim = int(head_size * float(rope_params.get("partial_rotary_factor", 1.0)))
    inv_freq = _INV_FREQ[rope_type](rope_params, rotary_dim, max_position)
    return RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, is_neox_style)
