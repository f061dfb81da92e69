"""Rotary position embedding (Su et al., 2021, "RoFormer"), with the frequency scalings that
Llama-family checkpoints use: linear position interpolation (Chen et al., 2023, "Extending
Context Window of Large Language Models via Positional Interpolation") and Llama 3.1's
wavelength-dependent scaling (Meta, 2024, "The Llama 3 Herd of Models"; reference code in
meta-llama/llama-models `apply_scaling`), and YaRN (Peng et al., 2023, "YaRN: Efficient Context
Window Extension of Large Language Models"), which DeepSeek-V2/V3 use with its mscale.

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


def _yarn_factor(params: dict[str, Any], max_position: int) -> float:
    """The context extension factor; without one, max_position / the pretraining context."""
    factor = params.get("factor")
    if factor is None:
        return max_position / float(params["original_max_position_embeddings"])
    return float(factor)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(scale) + 1 (1 without extension)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(params: dict[str, Any], rotary_dim: int, max_position: int) -> torch.Tensor:
    """YaRN's "NTK-by-parts": pairs that rotate more than `beta_fast` times over the pretraining
    context keep their frequency (extrapolation), those rotating fewer than `beta_slow` times are
    divided by `factor` (interpolation), and a linear ramp over the pair index blends between."""
    base, factor = float(params["rope_theta"]), _yarn_factor(params, max_position)
    original_context = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:  # the pair index that rotates that often
        return rotary_dim * math.log(original_context / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    wavelength_scale = base**exponents  # theta^(2i / d)
    keep = 1 - ramp  # 1: the pair keeps its frequency
    return 1.0 / (factor * wavelength_scale) * (1 - keep) + 1.0 / wavelength_scale * keep


def yarn_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """The scale YaRN applies to cos and sin: `attention_factor` when given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek's pair, which cancel when
    equal), else mscale(factor)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params, max_position)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all_dim))
    return yarn_get_mscale(factor)


def yarn_softmax_scale(params: dict[str, Any]) -> float:
    """DeepSeek's extra softmax scale under a scaled rope: mscale(factor, mscale_all_dim)
    squared (it multiplies q.k, where the cos/sin scale enters twice); 1 otherwise."""
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", "default") == "default" or not mscale_all_dim:
        return 1.0
    mscale = yarn_get_mscale(float(params["factor"]), float(mscale_all_dim))
    return mscale * mscale


_INV_FREQ: dict[str, Callable[[dict[str, Any], int, int], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}


class RotaryEmbedding(nn.Module):
    """Applies RoPE in place to the query and key of a flat batch, indexed by position."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        is_neox_style: bool,
        attention_factor: float = 1.0,
    ):
        """`attention_factor` scales cos and sin (YaRN's temperature; 1 for the others)."""
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # [max_position, rotary_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        cache = torch.cat((cos, sin), dim=-1)  # [max_position, rotary_dim]
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
    attention_factor = yarn_attention_factor(rope_params, max_position) if rope_type == "yarn" else 1.0
    return RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, is_neox_style, attention_factor)
