"""`FusedMoE`: the routed experts of one mixture-of-experts layer, stacked into two parameters.

This rank holds

    w13_weight [num_local_experts, 2 * intermediate_per_rank, hidden_size]   (gate rows, then up rows)
    w2_weight  [num_local_experts, hidden_size, intermediate_per_rank]

and `forward(hidden_states, topk_weights, topk_ids)` applies them with `fused_moe` (the Triton
kernels on CUDA, the pure-torch reference elsewhere).

How the experts are split over the tensor-parallel group (`ExpertPlacement`):

- tensor parallelism (default): every rank holds every expert and a 1/tp slice of each one's
  intermediate dimension, like a Megatron MLP (gate/up column-parallel, down row-parallel); the
  rank's output is a partial sum.
- expert parallelism (`expert_parallel=True`, by default the worker's `enable_expert_parallel`,
  see `parallel_state.expert_parallel_enabled`): rank r holds whole experts, a contiguous 1/tp of
  them, and computes only the choices of its own experts. The activations are replicated under
  tensor parallelism, so every rank already has every token (the dispatch needs no collective)
  and its output is again a partial sum: the same all-reduce combines both forms.

The output is all-reduced here only with `reduce_results=True`; a MoE block that adds shared
experts leaves it to one all-reduce over the sum (`SparseMoeBlock`).

Weight loading takes Hugging Face's two layouts: one tensor per expert and projection
(`experts.{e}.gate_proj/up_proj/down_proj.weight`, Mixtral's `experts.{e}.w1/w3/w2.weight`),
with shard id "w1", "w3" or "w2" and the expert's id; or the stacked tensors that transformers
5 keeps in memory and writes with `save_pretrained(save_original_format=False)`
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), with shard id "w13" or "w2"
and no expert id. `expert_checkpoint_target` maps a checkpoint name to its parameter.

How the weights are stored and multiplied is the layer's `moe_method` (the linear layers'
`linear_method` pattern): `UnquantizedMoEMethod` here; block-wise fp8
(shoal/layers/quantization/fp8_block_moe.py) adds its block scales, loaded by
`block_scale_loader`: the same cuts of the intermediate dimension, counted in blocks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shoal.distributed.parallel_state import expert_parallel_enabled, get_tp_group
from shoal.kernels.fused_moe import fused_moe
from shoal.layers.linear import divide
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.weight_utils import LoadedWeight, copy_weight, narrow_weight, new_parameter

logger = logging.getLogger(__name__)

# Per-expert checkpoint projections → shard ids (Qwen, DeepSeek; Mixtral).
GATE_UP_DOWN_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
MIXTRAL_PROJECTIONS = {"w1": "w1", "w3": "w3", "w2": "w2"}

# "<prefix>.experts.<e>.<projection>.<suffix>" and "<prefix>.experts.<gate_up_proj|down_proj>"
_PER_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<suffix>\w+)$")
_STACKED_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:\.(?P<suffix>\w+))?$")


def expert_checkpoint_target(name: str, projections: dict[str, str]) -> tuple[str, str, int | None] | None:
    """(parameter name, shard id, expert id or None) of a checkpoint tensor of routed experts,
    e.g. "m.experts.3.up_proj.weight" -> ("m.experts.w13_weight", "w3", 3) and
    "m.experts.gate_up_proj" -> ("m.experts.w13_weight", "w13", None); None for other names.
    The suffix carries over ("...down_proj.weight_scale_inv" -> "w2_weight_scale_inv")."""
    match = _PER_EXPERT_NAME.match(name)
    if match and match["proj"] in projections:
        shard_id = projections[match["proj"]]
        stacked = "w2" if shard_id == "w2" else "w13"
        return f"{match['prefix']}.{stacked}_{match['suffix']}", shard_id, int(match["expert"])
    match = _STACKED_NAME.match(name)
    if match:
        shard_id = "w13" if match["proj"] == "gate_up_proj" else "w2"
        return f"{match['prefix']}.{shard_id}_{match['suffix'] or 'weight'}", shard_id, None
    return None


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts and the slice of their intermediate dimension that one rank holds."""

    num_experts: int
    first_expert: int
    num_local_experts: int
    intermediate_size: int  # of one whole expert
    intermediate_start: int  # this rank's first intermediate row
    intermediate_per_rank: int

    @classmethod
    def for_rank(
        cls, num_experts: int, intermediate_size: int, tp_rank: int, tp_size: int, expert_parallel: bool
    ) -> ExpertPlacement:
        """Tensor parallelism splits the intermediate dimension; expert parallelism the experts
        (the first `num_experts % tp_size` ranks take one more)."""
        if not expert_parallel or tp_size == 1:
            per_rank = divide(intermediate_size, tp_size, "MoE intermediate size")
            return cls(num_experts, 0, num_experts, intermediate_size, tp_rank * per_rank, per_rank)
        if num_experts < tp_size:
            raise ValueError(f"expert parallelism needs at least one expert per rank: {num_experts} < {tp_size}")
        base, extra = divmod(num_experts, tp_size)
        first = tp_rank * base + min(tp_rank, extra)
        return cls(num_experts, first, base + (tp_rank < extra), intermediate_size, 0, intermediate_size)

    @property
    def is_expert_parallel(self) -> bool:
        return self.num_local_experts < self.num_experts

    @property
    def intermediate_rows(self) -> slice:
        return slice(self.intermediate_start, self.intermediate_start + self.intermediate_per_rank)

    def intermediate_cut(self, unit: int = 1) -> IntermediateCut:
        """This rank's slice of the intermediate dimension in units of `unit` rows (a block of
        block-wise scales; the caller checks that the cut falls on whole units, a short last
        unit allowed)."""
        return IntermediateCut(
            self.intermediate_start // unit,
            -(-self.intermediate_per_rank // unit),
            -(-self.intermediate_size // unit),
        )

    @property
    def local_experts(self) -> slice:
        return slice(self.first_expert, self.first_expert + self.num_local_experts)

    def local_index(self, expert_id: int) -> int | None:
        """This rank's row of global expert `expert_id`; None when another rank holds it."""
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def expert_map(self) -> torch.Tensor:
        """[num_experts] int32: global expert id -> local row, -1 for other ranks' experts."""
        expert_map = torch.full((self.num_experts,), -1, dtype=torch.int32)
        expert_map[self.local_experts] = torch.arange(self.num_local_experts, dtype=torch.int32)
        return expert_map


@dataclass(frozen=True)
class IntermediateCut:
    """This rank's part [start, start + length) of an expert's intermediate dimension of
    `total`, in rows of the weights or in blocks of their scales."""

    start: int
    length: int
    total: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


class MoEMethod(Protocol):
    """How a `FusedMoE` stores and applies its experts' weights."""

    def create_weights(self, layer: FusedMoE) -> None: ...

    def process_weights_after_loading(self, layer: FusedMoE) -> None: ...

    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor: ...


class UnquantizedMoEMethod:
    """Weights in the model's dtype; `fused_moe` over them."""

    def create_weights(self, layer: FusedMoE) -> None:
        p = layer.placement
        layer.w13_weight = new_parameter(
            p.num_local_experts, 2 * p.intermediate_per_rank, layer.hidden_size, weight_loader=layer.weight_loader
        )
        layer.w2_weight = new_parameter(
            p.num_local_experts, layer.hidden_size, p.intermediate_per_rank, weight_loader=layer.weight_loader
        )

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        return None

    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_map)


def get_moe_method(quant_config: Fp8Config | None, prefix: str) -> MoEMethod:
    """The MoE method of the experts named `prefix` under `quant_config`."""
    if quant_config is None or quant_config.is_layer_skipped(prefix):
        return UnquantizedMoEMethod()
    if quant_config.is_block_wise:
        from shoal.layers.quantization.fp8_block_moe import Fp8BlockMoEMethod

        return Fp8BlockMoEMethod(quant_config, prefix)
    raise ValueError(
        f"quantization {quant_config!r} is not supported for the experts of mixture-of-experts layers ({prefix})"
    )


def _read(loaded: LoadedWeight, *index: slice) -> torch.Tensor:
    """loaded[index] for a tensor or a lazy safetensors slice (which then reads only that part)."""
    return loaded[index]


class FusedMoE(nn.Module):
    """This rank's share of `num_experts` SwiGLU experts (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        expert_parallel: bool | None = None,
        reduce_results: bool = False,
        hidden_act: str = "silu",
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={hidden_act!r} is not supported for experts (only silu)")
        tp = get_tp_group()
        if expert_parallel is None:
            expert_parallel = expert_parallel_enabled()
        self.top_k = top_k  # the router's choices per token (what warm_up launches with)
        self.hidden_size = hidden_size
        self.reduce_results = reduce_results
        self.placement = ExpertPlacement.for_rank(
            num_experts, intermediate_size, tp.rank_in_group, tp.world_size, expert_parallel
        )
        self.expert_map: torch.Tensor | None
        if self.placement.is_expert_parallel:
            self.register_buffer("expert_map", self.placement.expert_map(), persistent=False)
        else:
            self.expert_map = None
        self.moe_method = get_moe_method(quant_config, prefix)
        self.moe_method.create_weights(self)

    @property
    def num_local_experts(self) -> int:
        return self.placement.num_local_experts

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden_size], the router's topk_weights/topk_ids
        [num_tokens, top_k] (global expert ids) -> [num_tokens, hidden_size]: this rank's partial
        sum, or the whole sum with `reduce_results`."""
        out = self.moe_method.apply(self, hidden_states, topk_weights, topk_ids)
        return get_tp_group().all_reduce(out) if self.reduce_results else out

    def process_weights_after_loading(self) -> None:
        self.moe_method.process_weights_after_loading(self)

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str, expert_id: int | None = None
    ) -> None:
        """Copy this rank's part of a checkpoint tensor: one expert's projection ("w1" gate,
        "w3" up, "w2" down, or "w13" gate and up stacked) when `expert_id` is given, else every
        expert stacked ("w13" [E, 2I, H], "w2" [E, H, I]). Another rank's expert is skipped."""
        cut = self.placement.intermediate_cut()
        self._load(param, loaded, shard_id, expert_id, cut, cut)

    def block_scale_loader(self, block_n: int, block_k: int) -> Callable[..., None]:
        """`weight_loader` for block scales: w13's [.., 2I / block_n, H / block_k] cut along its
        rows in blocks of block_n, w2's [.., H / block_n, I / block_k] along its columns in
        blocks of block_k."""
        p = self.placement

        def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: str, expert_id: int | None = None) -> None:
            self._load(param, loaded, shard_id, expert_id, p.intermediate_cut(block_n), p.intermediate_cut(block_k))

        return load

    def _load(
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_id: str,
        expert_id: int | None,
        w13_cut: IntermediateCut,
        w2_cut: IntermediateCut,
    ) -> None:
        if expert_id is None:
            self._load_stacked(param, loaded, shard_id, w13_cut, w2_cut)
            return
        local = self.placement.local_index(expert_id)
        if local is not None:
            self._load_expert(param.data[local], loaded, shard_id, w13_cut, w2_cut)

    def _load_expert(
        self,
        target: torch.Tensor,
        loaded: LoadedWeight,
        shard_id: str,
        w13_cut: IntermediateCut,
        w2_cut: IntermediateCut,
    ) -> None:
        """target: this rank's w13 [2 * I_rank, H] or w2 [H, I_rank] of one expert (I in the
        cuts' units)."""
        if shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else w13_cut.length
            copy_weight(target.narrow(0, offset, w13_cut.length), _read(loaded, w13_cut.rows))
        elif shard_id == "w2":
            copy_weight(target, narrow_weight(loaded, 1, w2_cut.start, w2_cut.length))
        elif shard_id == "w13":
            size = w13_cut.total
            self._load_expert(target, narrow_weight(loaded, 0, 0, size), "w1", w13_cut, w2_cut)
            self._load_expert(target, narrow_weight(loaded, 0, size, size), "w3", w13_cut, w2_cut)
        else:
            raise ValueError(f"unknown expert shard id {shard_id!r}")

    def _load_stacked(
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_id: str,
        w13_cut: IntermediateCut,
        w2_cut: IntermediateCut,
    ) -> None:
        """Every local expert from a stacked tensor, reading only this rank's experts and rows."""
        experts = self.placement.local_experts
        if shard_id == "w13":
            rows, size = w13_cut.rows, w13_cut.total
            up_rows = slice(size + rows.start, size + rows.stop)
            gate_up = torch.cat([_read(loaded, experts, rows), _read(loaded, experts, up_rows)], dim=1)
            copy_weight(param.data, gate_up)  # [num_local_experts, 2 * I_rank, H]
        elif shard_id == "w2":
            copy_weight(param.data, _read(loaded, experts, slice(None), w2_cut.rows))
        else:
            raise ValueError(f"unknown stacked expert shard id {shard_id!r}")

    @torch.inference_mode()
    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile the GPU kernels for every launch configuration a batch of up to
        `max_num_tokens` tokens can pick (see shoal/kernels/triton/fused_moe.py), so that no step
        of a run compiles one. Nothing on CPU."""
        if self.w13_weight.device.type != "cuda":
            return
        warm_up = getattr(self.moe_method, "warm_up_kernels", None)
        if warm_up is not None:  # a quantized method compiles its own kernels
            warm_up(self, max_num_tokens)
            return
        from shoal.kernels.fused_moe import warm_up_fused_moe

        warm_up_fused_moe(self.w13_weight, self.w2_weight, self.top_k, max_num_tokens, self.expert_map)

    def extra_repr(self) -> str:
        p = self.placement
        return (
            f"experts={p.num_local_experts}/{p.num_experts} (from {p.first_expert}), hidden={self.hidden_size}, "
            f"intermediate={p.intermediate_per_rank}/{p.intermediate_size}, {type(self.moe_method).__name__}"
        )


def load_expert_weights(
    weights: Iterable[tuple[str, Any]],
    params: dict[str, nn.Parameter],
    projections: dict[str, str],
    loaded: set[str],
    on_other_stage: Callable[[str], bool],
) -> Iterator[tuple[str, Any]]:
    """Load the routed experts' tensors among `weights` through their parameters'
    `weight_loader`s (adding the parameters' names to `loaded`) and yield every other
    (name, weight) for the model's own loading. `projections` names the per-expert
    projections (`GATE_UP_DOWN_PROJECTIONS`, `MIXTRAL_PROJECTIONS`); an experts' tensor with no
    parameter here belongs to another pipeline stage, or else is reported and skipped."""
    for name, weight in weights:
        target = expert_checkpoint_target(name, projections)
        if target is None:
            yield name, weight
            continue
        param_name, shard_id, expert_id = target
        param = params.get(param_name)
        if param is None:
            if not on_other_stage(name):
                logger.warning("checkpoint tensor %s matches no parameter; skipped", name)
            continue
        param.weight_loader(param, weight, shard_id, expert_id)  # type: ignore[attr-defined]
        loaded.add(param_name)
