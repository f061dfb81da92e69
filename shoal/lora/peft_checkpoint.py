"""An adapter in PEFT's layout, read and checked: adapter_config.json and
adapter_model.safetensors (or .bin is refused: no pickle).

Each target module `model.layers.{L}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj` has
`lora_A.weight` [r, in] and `lora_B.weight` [out, r]; its delta is `scaling * B A x` with
`scaling = lora_alpha / r` (`/ sqrt(r)` under `use_rslora`), folded into B here so that the
kernels only multiply. `rank_pattern` and `alpha_pattern` give a module its own rank and alpha.
The MoE experts' stacked parameters (`target_parameters`) are read by shoal/lora/peft_experts.py.
What shoal does not build is refused with a ValueError that names it: `modules_to_save`,
embedding adapters, DoRA, LoRA biases, modules outside the attention and MLP projections and
the experts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.lora.peft_experts import (
    EXPERT_PARAMETERS,
    check_expert_pair,
    expert_module_name,
    is_expert_module,
    refuse_per_expert_module,
    split_experts,
    targeted_expert_parameters,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their Hugging Face names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights: Hugging Face module name → (A [r, in], B [out, r] with its scaling
    folded in), on the CPU in float32."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # What each LoRA layer's slot takes, once checked against the model (shoal/lora/slots.py).
    slot_form: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def read_adapter_config(path: str | Path, max_lora_rank: int) -> dict:
    """The adapter's config, checked against what shoal builds (raises ValueError)."""
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter at {str(folder)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter at {str(folder)!r}: {CONFIG_FILE} is not JSON ({exc})") from None
    peft_type = config.get("peft_type", "LORA")
    _refuse(peft_type != "LORA", folder, f"peft_type {peft_type!r} is not LORA")
    _refuse(
        bool(config.get("modules_to_save")), folder, f"modules_to_save {config.get('modules_to_save')} is not supported"
    )
    _refuse(bool(config.get("use_dora")), folder, "DoRA (use_dora) is not supported")
    lora_bias = config.get("bias", "none") != "none" or bool(config.get("lora_bias"))
    _refuse(lora_bias, folder, "LoRA biases (bias / lora_bias) are not supported")
    try:
        targeted_expert_parameters(config)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter at {str(folder)!r}: {exc}") from None
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        _refuse(bool(unknown), folder, f"unknown target modules {unknown}; shoal adapts {list(TARGET_MODULES)}")
    ranks = [int(config.get("r", 8)), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    _refuse(max(ranks) > max_lora_rank, folder, f"rank {max(ranks)} is over max_lora_rank={max_lora_rank}")
    return config


def load_adapter(name: str, path: str | Path, max_lora_rank: int, num_layers: int) -> LoRAAdapter:
    """Read the adapter at `path` (raises ValueError for anything shoal cannot serve)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = read_adapter_config(folder, max_lora_rank)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise ValueError(f"LoRA adapter at {str(folder)!r} has no {WEIGHTS_FILE}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in load_file(str(weights_file)).items():
        match = _TENSOR.match(tensor_name)
        _refuse(match is None, folder, f"tensor {tensor_name!r} is not a LoRA A or B of a projection")
        assert match is not None
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor.float()
    adapter = LoRAAdapter(name, str(folder), rank=0)
    for module, pair in sorted(pairs.items()):
        _refuse(set(pair) != {"lora_A", "lora_B"}, folder, f"module {module!r} lacks its lora_A or lora_B")
        try:
            module, lora_a, lora_b, rank = _read_module(module, pair, config, num_layers)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter at {str(folder)!r}: {exc}") from None
        _refuse(rank > max_lora_rank, folder, f"module {module!r} has rank {rank}, over max_lora_rank={max_lora_rank}")
        adapter.modules[module] = (lora_a, lora_b)
        adapter.rank = max(adapter.rank, rank)
    _refuse(not adapter.modules, folder, "it holds no LoRA weights")
    check_expert_pair(folder, adapter.modules)
    return adapter


def _read_module(
    module: str, pair: dict[str, torch.Tensor], config: dict, num_layers: int
) -> tuple[str, torch.Tensor, torch.Tensor, int]:
    """(shoal's module name, A, B with the scaling folded in, rank) of one PEFT module: a
    projection's A [r, in] and B [out, r], or the MoE experts' stacked A [E, r, in] and
    B [E, out, r] (shoal/lora/peft_experts.py); raises ValueError."""
    lora_a, lora_b = pair["lora_A"], pair["lora_B"]
    if is_expert_module(module):
        module = expert_module_name(module, config)
        _check_layer(module, int(module.split(".")[2]), num_layers)
        rank = _rank(config, module)
        lora_a, lora_b = split_experts(module, lora_a, lora_b, rank)
        return module, lora_a, lora_b * _scaling(config, module, rank), rank
    _check_module(module, num_layers)
    rank = lora_a.shape[0]
    if lora_b.shape[1] != rank:
        raise ValueError(f"module {module!r}: lora_A has rank {rank}, lora_B {lora_b.shape[1]}")
    return module, lora_a, lora_b * _scaling(config, module, rank), rank


def _check_module(module: str, num_layers: int) -> None:
    """A projection's PEFT module name must be one shoal adapts (raises ValueError)."""
    match = _MODULE.match(module)
    if "embed" in module or "lm_head" in module:
        raise ValueError(f"embedding / LM-head adapters ({module}) are not supported")
    refuse_per_expert_module(module)
    if match is None or match.group(3) not in TARGET_MODULES:
        raise ValueError(
            f"unknown target module {module!r}; shoal adapts {list(TARGET_MODULES)} of the decoder layers "
            f"and the MoE experts' {list(EXPERT_PARAMETERS)} (target_parameters)"
        )
    _check_layer(module, int(match.group(1)), num_layers)


def _check_layer(module: str, layer: int, num_layers: int) -> None:
    if layer >= num_layers:
        raise ValueError(f"module {module!r}: the model has {num_layers} layers")


def _pattern_value(config: dict, key: str, module: str, default: float) -> float:
    """A module's value in `rank_pattern` or `alpha_pattern` (matched on the name's end)."""
    for pattern, value in (config.get(key) or {}).items():
        if module == pattern or module.endswith("." + pattern):
            default = value
    return float(default)


def _rank(config: dict, module: str) -> int:
    """A module's rank where its tensors do not say it (the experts': r times E rows)."""
    return int(_pattern_value(config, "rank_pattern", module, int(config.get("r", 8))))


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of one module: its alpha (alpha_pattern's, matched on the name's end)
    over its rank, or over the rank's square root with rsLoRA."""
    alpha = _pattern_value(config, "alpha_pattern", module, float(config.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _refuse(bad: bool, folder: Path, why: str) -> None:
    if bad:
        raise ValueError(f"LoRA adapter at {str(folder)!r}: {why}")


def modules_from_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], config: dict, num_layers: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-named tensors (a trainer's `get_peft_model_state_dict`) → module → (A, B with the
    module's scaling under the adapter's `config`)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in named_tensors:
        match = _TENSOR.match(tensor_name)
        if match is None:
            raise ValueError(f"tensor {tensor_name!r} is not a LoRA A or B of a projection")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor.detach().float().cpu()
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"module {module!r} needs both its lora_A and lora_B in one update")
        name, lora_a, lora_b, _ = _read_module(module, pair, config, num_layers)
        modules[name] = (lora_a, lora_b)
    check_expert_pair(Path("<tensors>"), modules)
    return modules
