"""The LoRA wrapper of a linear layer: the base layer's product plus each token's adapter delta
(shoal/kernels/lora.py), with no branch in the layers themselves.

`add_lora(layer, ...)` turns a `QKVParallelLinear`, `MergedColumnParallelLinear` or
`RowParallelLinear` into a LoRA layer in place (its class becomes a subclass with the delta in
`forward`), so its parameters keep their names and every weight loader and RL update still finds
them. Its adapters live in stacked slot tensors:

    lora_a [max_loras, num_slices * max_lora_rank, input features on this rank]
    lora_b [max_loras, output features on this rank, num_slices * max_lora_rank]

one slice per fused part (q, k, v; gate, up; one for o and down), block-diagonal in B, so a
fused projection is still one shrink and one expand. Tensor parallelism cuts A and B like the
base weight (Megatron): column-parallel layers keep A whole and B's rows of this rank;
row-parallel ones keep A's columns of this rank, and the shrink's partial sums are all-reduced
before the expand with the whole B. With `fully_sharded_loras` a column-parallel layer also
splits A's rank rows (the shrink's outputs are all-gathered) and a row-parallel layer B's rows
(the expand's outputs are all-gathered): less memory per rank, one more small collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.distributed.parallel_state import get_tp_group
from shoal.kernels.lora import (
    LoRASegments,
    lora_expand,
    lora_expand_grouped,
    lora_shrink,
    lora_shrink_grouped,
    sort_tokens_by_slot,
)
from shoal.layers.activation import silu_and_mul
from shoal.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass
class TokenSlots:
    """The step's adapter slot of every token (-1: the base model), in a static device buffer
    every LoRA layer reads its first `num_tokens` rows of (a CUDA graph replays with it)."""

    slots: torch.Tensor  # [max_num_tokens] int32
    # The same step's tokens sorted by slot (static device buffers too), for the GPU kernels.
    segments: LoRASegments
    # Eager steps in which no token has an adapter skip the deltas (never under CUDA graphs,
    # whose captured forwards must include them); the MoE experts' deltas likewise in eager
    # steps whose adapters have none (shoal/lora/expert_layers.py).
    active: bool = True
    experts_active: bool = True
    # A long eager step's tokens grouped by slot (slot, its rows), for the grouped GEMMs, and
    # the step's token count they were made for (a forward of another size never uses them: a
    # CUDA-graph capture of a decode size after a long step does not).
    groups: list[tuple[int, torch.Tensor]] | None = None
    groups_num_tokens: int = -1

    @classmethod
    def of(cls, slots: torch.Tensor, num_slots: int) -> TokenSlots:
        """The buffers of one slot map (a forward outside the engine's steps: tests)."""
        packed = sort_tokens_by_slot(slots.cpu().numpy(), num_slots)
        return cls(slots, LoRASegments.of(torch.from_numpy(packed).to(slots.device), num_slots))

    def grouped(self, num_tokens: int) -> list[tuple[int, torch.Tensor]] | None:
        return self.groups if num_tokens == self.groups_num_tokens else None


def shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: TokenSlots) -> torch.Tensor:
    groups = token_slots.grouped(x.shape[0])
    if groups is not None:
        return lora_shrink_grouped(x, lora_a, groups)
    return lora_shrink(x, lora_a, token_slots.slots[: x.shape[0]], token_slots.segments)


def expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, token_slots: TokenSlots) -> torch.Tensor:
    groups = token_slots.grouped(y.shape[0])
    if groups is not None:
        return lora_expand_grouped(y, h, lora_b, groups)
    return lora_expand(y, h, lora_b, token_slots.slots[: y.shape[0]], token_slots.segments)


# Each wrapped layer's slices: (the base layer's shard id, the Hugging Face module name's part
# the base layer's prefix has in its place).
_QKV_SLICES = (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"))
_GATE_UP_SLICES = ((0, "gate_proj"), (1, "up_proj"))


class LoRALayer:
    """What every LoRA layer adds to its base class (the `LinearBase` it wraps)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_slices: tuple[tuple[str | int | None, str], ...]
    lora_rank: int  # max_lora_rank: each slice's width in the stacked rank dimension
    fully_sharded: bool
    token_slots: TokenSlots

    def lora_module_names(self) -> list[str]:
        """The Hugging Face module name of each slice (an adapter's tensors are found by them)."""
        prefix: str = self.prefix  # type: ignore[attr-defined]
        fused = prefix.rsplit(".", 1)[-1]
        parent = prefix.rsplit(".", 1)[0]
        return [prefix if not part or fused == part else f"{parent}.{part}" for _, part in self.lora_slices]


class ColumnLoRALayer(LoRALayer):
    """QKV and gate-up (column-parallel): y += B_rank (A x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # type: ignore[misc]
        if not self.token_slots.active:
            return y
        h = shrink(x, self.lora_a, self.token_slots)  # [num_tokens, num_slices * rank (/ tp: fully sharded)]
        if self.fully_sharded:
            h = get_tp_group().all_gather(h, dim=-1)  # [num_tokens, num_slices * rank]
        return expand(y, h, self.lora_b, self.token_slots)

    def slot_tensors(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of one adapter, zero where it has no slice or a smaller rank."""
        base: LinearBase = self  # type: ignore[assignment]
        width = len(self.lora_slices) * self.lora_rank
        lora_a = torch.zeros(width, base.input_size)
        lora_b = torch.zeros(base.output_size, width)
        for i, ((shard_id, _), name) in enumerate(zip(self.lora_slices, self.lora_module_names())):
            if name not in modules:
                continue
            a, b = modules[name]
            check_shape(name, "lora_A", a, (a.shape[0], base.checkpoint_input_size()))
            check_shape(name, "lora_B", b, (base.checkpoint_output_size(shard_id), a.shape[0]))
            first_row, rank_row, num_rows = base.output_shard(shard_id)
            column = i * self.lora_rank
            lora_a[column : column + a.shape[0]] = a
            lora_b[rank_row : rank_row + num_rows, column : column + a.shape[0]] = b[first_row : first_row + num_rows]
        if self.fully_sharded:  # this rank's share of the rank rows
            tp = get_tp_group()
            share = width // tp.world_size
            lora_a = lora_a[tp.rank_in_group * share : (tp.rank_in_group + 1) * share]
        return lora_a, lora_b


class RowLoRALayer(LoRALayer):
    """o_proj and down_proj (row-parallel): y += B allreduce(A_rank x_rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # type: ignore[misc]
        return self._add_delta(x, y)

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The base layer's fused SwiGLU product where its linear method has one (then the
        delta on silu(gate) * up), else silu_and_mul and `forward`, delta included."""
        base: RowParallelLinear = self  # type: ignore[assignment]
        y = base.linear_method.apply_swiglu(base, gate_up, base.bias if base.tp_rank == 0 else None)
        if y is None:
            return self.forward(silu_and_mul(gate_up))
        y = get_tp_group().all_reduce(y) if base.reduce_results else y
        return self._add_delta(silu_and_mul(gate_up), y) if self.token_slots.active else y

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.token_slots.active:
            return y
        base: RowParallelLinear = self  # type: ignore[assignment]
        if not base.input_is_parallel:
            x = x.narrow(-1, base.tp_rank * base.input_size, base.input_size)
        h = shrink(x, self.lora_a, self.token_slots)  # [num_tokens, rank], this rank's partial sum
        if not base.reduce_results:  # the caller sums the ranks' outputs: the delta's too
            return expand(y, h, self.lora_b, self.token_slots)
        h = get_tp_group().all_reduce(h)
        if not self.fully_sharded:
            return expand(y, h, self.lora_b, self.token_slots)
        zeros = torch.zeros(y.shape[0], self.lora_b.shape[1], dtype=y.dtype, device=y.device)
        delta = expand(zeros, h, self.lora_b, self.token_slots)
        return y + get_tp_group().all_gather(delta, dim=-1)  # [num_tokens, output_size]

    def slot_tensors(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        base: RowParallelLinear = self  # type: ignore[assignment]
        (name,) = self.lora_module_names()
        lora_a = torch.zeros(self.lora_rank, base.input_size)
        lora_b = torch.zeros(base.output_size, self.lora_rank)
        if name in modules:
            a, b = modules[name]
            check_shape(name, "lora_A", a, (a.shape[0], base.checkpoint_input_size()))
            check_shape(name, "lora_B", b, (base.output_size, a.shape[0]))
            first_column, num_columns = base.input_shard()
            lora_a[: a.shape[0]] = a[:, first_column : first_column + num_columns]
            lora_b[:, : a.shape[0]] = b
        if self.fully_sharded:
            tp = get_tp_group()
            share = base.output_size // tp.world_size
            lora_b = lora_b[tp.rank_in_group * share : (tp.rank_in_group + 1) * share]
        return lora_a, lora_b


def add_lora(
    layer: LinearBase,
    max_loras: int,
    max_lora_rank: int,
    token_slots: TokenSlots,
    dtype: torch.dtype,
    fully_sharded: bool,
) -> LoRALayer:
    """Make `layer` a LoRA layer in place, with `max_loras` empty slots."""
    mixin: type[LoRALayer]
    slices: tuple[tuple[str | int | None, str], ...]
    if isinstance(layer, QKVParallelLinear):
        mixin, slices = ColumnLoRALayer, _QKV_SLICES
    elif isinstance(layer, MergedColumnParallelLinear) and len(layer.output_sizes) == 2:
        mixin, slices = ColumnLoRALayer, _GATE_UP_SLICES
    elif isinstance(layer, RowParallelLinear):
        mixin, slices = RowLoRALayer, ((None, ""),)
    else:
        raise ValueError(f"no LoRA wrapper for {type(layer).__name__} ({layer.prefix})")
    base_cls = type(layer)
    layer.__class__ = type(f"LoRA{base_cls.__name__}", (mixin, base_cls), {})
    lora: LoRALayer = layer  # type: ignore[assignment]
    lora.lora_slices, lora.lora_rank = slices, max_lora_rank
    lora.fully_sharded, lora.token_slots = fully_sharded, token_slots
    empty_a, empty_b = lora.slot_tensors({})  # type: ignore[attr-defined]
    device = next(layer.parameters()).device
    lora.lora_a = torch.zeros(max_loras, *empty_a.shape, dtype=dtype, device=device)
    lora.lora_b = torch.zeros(max_loras, *empty_b.shape, dtype=dtype, device=device)
    return lora


def check_shape(module: str, what: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"{module}.{what} has shape {list(tensor.shape)}, but the base model's layer needs {list(expected)}"
        )
