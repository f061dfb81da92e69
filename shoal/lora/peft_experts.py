"""LoRA on the routed experts of a mixture-of-experts layer, in PEFT's layout for transformers 5's
stacked experts (`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`).

PEFT adapts a 3-D parameter W [E, out, in] (transformers' `F.linear(x, W[e])` order) with one
`ParamWrapper` per parameter: lora_A is an nn.Linear(in, r * E), lora_B an nn.Linear(r * E, out),
and expert e's delta is `scaling * B_e A_e` with

    A_e = lora_A.weight[e * r : (e + 1) * r]      [r, in]    (rows expert-major)
    B_e = lora_B.weight[:, e :: E]                [out, r]   (columns rank-major: k * E + e)

(peft/tuners/lora/layer.py `ParamWrapper.get_delta_factors`; the experts' (E, out, in) order is
the one in which PEFT swaps its in and out features). Two parameters of one module are wrapped
one inside the other, in the order the module declares them: gate_up_proj innermost, so with both
targeted the checkpoint names `experts.base_layer.lora_A` gate_up's and `experts.lora_A` down's.

Read here into shoal's form, one module per stacked projection (shoal/lora/peft_checkpoint.py
folds the scaling into B, as for every module):

    model.layers.{L}.mlp.experts.gate_up_proj   A [E, r, hidden]        B [E, 2 * intermediate, r]
    model.layers.{L}.mlp.experts.down_proj      A [E, r, intermediate]  B [E, hidden, r]
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# The experts' stacked parameters, in the order transformers' experts modules declare them.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_WRAPPER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)$")
_PER_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.\w+$")


def targeted_expert_parameters(config: dict) -> list[str]:
    """The experts' parameters the adapter's `target_parameters` name (raises ValueError for any
    other parameter), in declaration order: the innermost PEFT wrapper first."""
    targets = config.get("target_parameters") or []
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS]
    if unknown:
        raise ValueError(
            f"unknown target parameters {unknown}; shoal adapts the MoE experts' {list(EXPERT_PARAMETERS)}"
        )
    named = {t.rsplit(".", 1)[-1] for t in targets}
    return [p for p in EXPERT_PARAMETERS if p in named]


def is_expert_module(module: str) -> bool:
    """Whether a PEFT module name is a wrapper of the experts' stacked parameters."""
    return _WRAPPER.match(module) is not None


def refuse_per_expert_module(module: str) -> None:
    if _PER_EXPERT.match(module):
        raise ValueError(
            f"LoRA on one expert's module ({module}, transformers 4's per-expert layout) is not supported; "
            "shoal reads PEFT's target_parameters on the stacked experts (transformers 5)"
        )


def expert_module_name(module: str, config: dict) -> str:
    """shoal's name of a PEFT expert wrapper ("...mlp.experts.base_layer" with both parameters
    targeted -> "...mlp.experts.gate_up_proj"); raises ValueError."""
    match = _WRAPPER.match(module)
    assert match is not None
    targeted = targeted_expert_parameters(config)
    depth = match.group(2).count(".base_layer")
    if depth >= len(targeted):
        raise ValueError(f"module {module!r} matches none of target_parameters {config.get('target_parameters')}")
    return f"model.layers.{match.group(1)}.mlp.experts.{targeted[len(targeted) - 1 - depth]}"


def split_experts(
    name: str, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrapper's (lora_A [r * E, in], lora_B [out, r * E]) as (A [E, r, in], B [E, out, r]);
    raises ValueError."""
    rows = lora_a.shape[0]
    if rows % rank or lora_b.shape[1] != rows:
        raise ValueError(
            f"module {name!r}: lora_A {list(lora_a.shape)} and lora_B {list(lora_b.shape)} are not rank {rank} "
            "times a number of experts"
        )
    num_experts = rows // rank
    a = lora_a.reshape(num_experts, rank, lora_a.shape[1])  # [E, r, in]
    b = lora_b.reshape(lora_b.shape[0], rank, num_experts).permute(2, 0, 1)  # [E, out, r]
    return a.contiguous(), b.contiguous()


def check_expert_pair(folder: Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """With both projections of a layer present, their shapes must agree (gate_up's input is
    down's output, its output twice down's input): a checkpoint whose wrappers were nested in
    another order is refused rather than read crosswise."""
    for name, (a, b) in modules.items():
        if not name.endswith(".experts.gate_up_proj"):
            continue
        down = modules.get(name.replace("gate_up_proj", "down_proj"))
        if down is not None and (a.shape[2] != down[1].shape[1] or b.shape[1] != 2 * down[0].shape[2]):
            raise ValueError(
                f"LoRA adapter at {str(folder)!r}: {name} (A {list(a.shape)}, B {list(b.shape)}) and its "
                f"down_proj (A {list(down[0].shape)}, B {list(down[1].shape)}) do not fit one expert"
            )
