"""Which linear layers run in fp8 (e4m3) and how: read from a checkpoint's `quantization_config`,
or chosen with `quantization="fp8"` for a float checkpoint. Imports no torch, so that
shoal/config.py can reject a checkpoint shoal cannot run before anything is loaded.

Two checkpoint formats store fp8 weights with one scale per tensor or per output channel:

- `quant_method: "fp8"` (vLLM's and AutoFP8's format): `activation_scheme` "dynamic" or
  "static", and `ignored_layers` (or Hugging Face's `modules_to_not_convert`).
- `quant_method: "compressed-tensors"` (llm-compressor's FP8 and FP8_DYNAMIC schemes):
  `config_groups` targeting `Linear` whose weights are symmetric 8-bit floats per tensor or per
  channel and whose input activations are dynamic, static per tensor, or absent; `ignore`.

Either way a quantized layer's tensors are `weight` (float8_e4m3fn [out, in]), `weight_scale`
(a scalar per tensor, or [out] / [out, 1] per channel) and, for static activations,
`input_scale` (a scalar). Layers listed as ignored are stored in float and stay float.

The block-wise variant of the "fp8" format (DeepSeek-V3's): `weight_block_size: [block_n,
block_k]` (128 x 128 in the published checkpoints), `activation_scheme: "dynamic"`, `fmt: "e4m3"`.
A layer's tensors are `weight` (float8_e4m3fn [out, in]) and `weight_scale_inv` (float32
[ceil(out / block_n), ceil(in / block_k)], the factor that dequantizes each block); activations
are quantized per token and group of block_k at run time (shoal/layers/quantization/fp8_block.py).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ACTIVATION_SCHEMES = ("dynamic", "static")

# The checkpoint layers that shoal fuses into one linear layer (see STACKED_PARAMS in
# shoal/models/llama.py): an ignore list names the checkpoint layers, not the fused one.
FUSED_LAYERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# Checkpoint tensors that shoal reads no value from: zero points of a symmetric scheme (all
# zero), and KV-cache scales (the KV cache stays in the model's dtype).
_UNUSED_SUFFIXES = (".weight_zero_point", ".input_zero_point", ".output_scale", ".k_scale", ".v_scale", ".q_scale")


@dataclass(frozen=True)
class Fp8Config:
    """fp8 linear layers. `is_checkpoint_fp8`: the checkpoint stores e4m3 weights with scales;
    otherwise float weights are quantized per output channel after loading. Activations are
    quantized per token at run time ("dynamic") or with the checkpoint's per-tensor
    `input_scale` ("static")."""

    is_checkpoint_fp8: bool = False
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()
    weight_block_size: tuple[int, int] | None = None  # (block_n, block_k): block-wise weight scales

    @property
    def is_block_wise(self) -> bool:
        return self.weight_block_size is not None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Fp8Config:
        """The checkpoint's fp8 scheme, or on-the-fly quantization for an unquantized checkpoint;
        raises ValueError for a quantization shoal cannot run."""
        config = quantization_config_of(hf_config)
        if config is None:
            return cls()
        method = config.get("quant_method")
        if method == "fp8":
            return _from_fp8_format(config)
        if method == "compressed-tensors":
            return _from_compressed_tensors(config)
        raise ValueError(f"checkpoint quantization {method!r} is not supported (only fp8 and compressed-tensors fp8)")

    def is_layer_skipped(self, prefix: str) -> bool:
        """Whether the linear layer named `prefix` ("model.layers.0.self_attn.qkv_proj") stays
        float. A fused layer is skipped when all of its checkpoint layers are ignored; a fused
        layer that is partly ignored cannot be loaded into one fp8 weight."""
        names = checkpoint_layer_names(prefix)
        skipped = [self._is_ignored(name) for name in names]
        if any(skipped) and not all(skipped):
            raise ValueError(f"{prefix} fuses {names}, of which only some are quantized; shoal cannot load that")
        return all(skipped)

    def is_unused_tensor(self, name: str) -> bool:
        """Checkpoint tensors the fp8 layers do not read (skipped without a warning)."""
        if self.activation_scheme == "dynamic" and name.endswith(".input_scale"):
            return True
        return name.endswith(_UNUSED_SUFFIXES)

    def _is_ignored(self, name: str) -> bool:
        for pattern in self.ignored_layers:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], name):
                    return True
            elif name == pattern or name.endswith("." + pattern):
                return True
        return False


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The checkpoint's quantization: "fp8" when its weights are fp8, None when unquantized;
    ValueError for any other quantization (or an fp8 variant that shoal cannot run)."""
    if quantization_config_of(hf_config) is None:
        return None
    Fp8Config.from_hf_config(hf_config)  # validates
    return "fp8"


def checkpoint_layer_names(prefix: str) -> list[str]:
    """The checkpoint layers behind a shoal layer: "x.qkv_proj" -> ["x.q_proj", "x.k_proj", "x.v_proj"]."""
    parent, _, name = prefix.rpartition(".")
    parts = FUSED_LAYERS.get(name)
    if parts is None:
        return [prefix]
    return [f"{parent}.{part}" if parent else part for part in parts]


def _from_fp8_format(config: dict[str, Any]) -> Fp8Config:
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"fp8 activation_scheme must be one of {ACTIVATION_SCHEMES}, got {scheme!r}")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported (only e4m3)")
    ignored = [*(config.get("ignored_layers") or ()), *(config.get("modules_to_not_convert") or ())]
    block_size = _weight_block_size(config.get("weight_block_size"))
    if block_size is not None and scheme != "dynamic":
        raise ValueError("block-wise fp8 (weight_block_size) needs activation_scheme 'dynamic'")
    return Fp8Config(
        is_checkpoint_fp8=True, activation_scheme=scheme, ignored_layers=tuple(ignored), weight_block_size=block_size
    )


def _weight_block_size(value: Any) -> tuple[int, int] | None:
    """`weight_block_size` as (block_n, block_k): two positive integers, or None when absent."""
    if value is None:
        return None
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(f"fp8 weight_block_size must be two positive integers [block_n, block_k], got {value!r}")
    return int(value[0]), int(value[1])


def _from_compressed_tensors(config: dict[str, Any]) -> Fp8Config:
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (only float-quantized fp8)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = {_compressed_tensors_group_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors groups mix activation schemes {sorted(schemes)}; shoal needs one")
    if config.get("kv_cache_scheme"):
        logger.warning("kv_cache_scheme is ignored: the KV cache stays in the model's dtype")
    return Fp8Config(
        is_checkpoint_fp8=True, activation_scheme=schemes.pop(), ignored_layers=tuple(config.get("ignore") or ())
    )


def _compressed_tensors_group_scheme(name: str, group: dict[str, Any]) -> str:
    """The activation scheme of one config group, after checking that its weights are fp8 with
    one scale per tensor or per channel."""
    targets = group.get("targets") or []
    if "Linear" not in targets:
        raise ValueError(f"compressed-tensors group {name!r} targets {targets}; shoal supports 'Linear'")
    weights = group.get("weights") or {}
    if not (
        weights.get("type") == "float"
        and weights.get("num_bits") == 8
        and weights.get("strategy") in ("tensor", "channel")
        and weights.get("symmetric", True)
        and not weights.get("dynamic", False)
    ):
        raise ValueError(
            f"compressed-tensors group {name!r} weights {weights} are not supported "
            "(only symmetric 8-bit float, per tensor or per channel)"
        )
    activations = group.get("input_activations")
    if activations is None:
        return "dynamic"  # weight-only fp8: activations are quantized per token at run time
    if activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors group {name!r} input activations {activations} are not 8-bit float")
    if activations.get("dynamic", False):
        return "dynamic"
    if activations.get("strategy") != "tensor":
        raise ValueError(f"compressed-tensors group {name!r}: static activation scales must be per tensor")
    return "static"
