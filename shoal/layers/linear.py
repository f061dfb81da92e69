"""Linear layers split across the tensor-parallel group (Shoeybi et al., 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism", section 3).

A column-parallel layer splits the output features: rank r holds rows `[r * n, (r + 1) * n)` of
the weight and produces its slice of the output. A row-parallel layer splits the input features,
so each rank computes a partial sum of the full output that an all-reduce completes. A Megatron
MLP or attention block is column-parallel then row-parallel, with one all-reduce at the end.

Every parameter carries `weight_loader(param, loaded_weight[, shard_id])`, which copies this
rank's shard of the full Hugging Face tensor into it.

How the weight is stored and multiplied is the layer's `linear_method`
(shoal/layers/quantization/): float by default, fp8 under an `Fp8Config` unless the config
leaves the layer (by its checkpoint name, `prefix`) in float. The loader calls
`process_weights_after_loading` once every checkpoint tensor is in.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shoal.distributed.parallel_state import get_tp_group
from shoal.layers.activation import silu_and_mul
from shoal.layers.quantization.base import LinearMethod, UnquantizedLinearMethod
from shoal.layers.quantization.fp8 import Fp8LinearMethod
from shoal.layers.quantization.fp8_block import Fp8BlockLinearMethod
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.weight_utils import (
    LoadedWeight,
    copy_weight,
    default_weight_loader,
    narrow_weight,
    new_parameter,
    weight_shape,
)

logger = logging.getLogger(__name__)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def get_linear_method(quant_config: Fp8Config | None, prefix: str) -> LinearMethod:
    """The linear method of the layer named `prefix` (its parameter-name prefix, e.g.
    "model.layers.0.mlp.down_proj") under `quant_config`."""
    if quant_config is None or quant_config.is_layer_skipped(prefix):
        return UnquantizedLinearMethod()
    if quant_config.is_block_wise:
        return Fp8BlockLinearMethod(quant_config)
    return Fp8LinearMethod(quant_config)


class LinearBase(nn.Module):
    """y = x W^T + b with this rank's [output_size, input_size] weight (sizes per rank)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        weight_loader=default_weight_loader,
        *,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.prefix = prefix
        self.linear_method = get_linear_method(quant_config, prefix)
        self.linear_method.create_weights(self, weight_loader)
        self.bias = new_parameter(output_size, weight_loader=weight_loader) if bias else None

    def checkpoint_output_size(self, shard_id: str | int | None = None) -> int:
        """Rows of the checkpoint tensor that `weight_loader(param, loaded[, shard_id])` takes."""
        return self.output_size

    # Where this rank's shard lies, for loaders that split a checkpoint tensor in other units
    # than rows and columns (block-wise fp8 scales); the weight loaders below cut the same shards.

    def output_shard_ids(self) -> tuple[str | int | None, ...]:
        """The shard ids of the checkpoint tensors fused into this layer's rows (None: one tensor)."""
        return (None,)

    def output_shard(self, shard_id: str | int | None = None) -> tuple[int, int, int]:
        """(first row in the checkpoint tensor, first row in this rank's weight, number of rows)
        of this rank's part of checkpoint tensor `shard_id`."""
        return 0, 0, self.output_size

    def input_shard(self) -> tuple[int, int]:
        """(first column in the checkpoint tensor, number of columns) of this rank's weight."""
        return 0, self.input_size

    def checkpoint_input_size(self) -> int:
        return self.input_size

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """Compile the linear method's GPU kernels ahead of a run, where it has any to compile
        per batch size (block-wise fp8); nothing otherwise."""
        warm_up = getattr(self.linear_method, "warm_up_kernels", None)
        if warm_up is not None:
            warm_up(self, max_num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        method = type(self.linear_method).__name__
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp_size}, {method}"
        )


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; `gather_output` all-gathers the full output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        *,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        tp_size = get_tp_group().world_size
        output_size_per_rank = divide(output_size, tp_size, "output size")
        super().__init__(
            input_size, output_size_per_rank, bias, self.weight_loader, quant_config=quant_config, prefix=prefix
        )
        self.gather_output = gather_output

    def checkpoint_output_size(self, shard_id: str | int | None = None) -> int:
        return self.output_size * self.tp_size

    def output_shard(self, shard_id: str | int | None = None) -> tuple[int, int, int]:
        return self.tp_rank * self.output_size, 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        shard_size = param.shape[0]
        copy_weight(param.data, narrow_weight(loaded, 0, self.tp_rank * shard_size, shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x, self.bias)  # [num_tokens, output_size / tp]
        return get_tp_group().all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with the same input fused into one matmul (e.g. the MLP's
    gate and up projections). Rank r's weight is [shard r of output 0; shard r of output 1; ...]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        *,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        tp_size = get_tp_group().world_size
        self.output_sizes = [divide(size, tp_size, "output size") * tp_size for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, quant_config=quant_config, prefix=prefix)

    def checkpoint_output_size(self, shard_id: str | int | None = None) -> int:
        return sum(self.output_sizes) if shard_id is None else self.output_sizes[int(shard_id)]

    def output_shard_ids(self) -> tuple[str | int | None, ...]:
        return tuple(range(len(self.output_sizes)))

    def output_shard(self, shard_id: str | int | None = None) -> tuple[int, int, int]:
        if shard_id is None:
            raise ValueError("a fused layer's shard needs its shard id")
        shard_size = self.output_sizes[int(shard_id)] // self.tp_size
        offset = sum(self.output_sizes[: int(shard_id)]) // self.tp_size
        return self.tp_rank * shard_size, offset, shard_size

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: int | None = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor
            offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            for i, (offset, size) in enumerate(zip(offsets, self.output_sizes)):
                self.weight_loader(param, narrow_weight(loaded, 0, offset, size), i)
            return
        shard_size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        source = narrow_weight(loaded, 0, self.tp_rank * shard_size, shard_size)
        copy_weight(param.data.narrow(0, offset, shard_size), source)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused, split by attention head.

    Rank r holds query heads `[r * nh, (r + 1) * nh)` and, when there are at least as many KV
    heads as ranks, KV heads `[r * nkv, (r + 1) * nkv)`. With fewer KV heads than ranks each rank
    holds one KV head, KV head `r // (tp_size / total_num_kv_heads)`: the ranks that share it
    keep replicas, so that grouped-query attention stays local to each rank.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        *,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        tp_size = get_tp_group().world_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tensor-parallel size")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, quant_config=quant_config, prefix=prefix)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def checkpoint_output_size(self, shard_id: str | int | None = None) -> int:
        q_total = self.total_num_heads * self.head_size
        kv_total = self.total_num_kv_heads * self.head_size
        sizes: dict[str | int | None, int] = {None: q_total + 2 * kv_total, "q": q_total, "k": kv_total, "v": kv_total}
        return sizes[shard_id]

    def output_shard_ids(self) -> tuple[str | int | None, ...]:
        return ("q", "k", "v")

    def output_shard(self, shard_id: str | int | None = None) -> tuple[int, int, int]:
        if shard_id == "q":
            return self.tp_rank * self.q_size, 0, self.q_size
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            return (self.tp_rank // self.num_kv_head_replicas) * self.kv_size, offset, self.kv_size
        raise ValueError(f"unknown QKV shard id {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor
            q_total = self.total_num_heads * self.head_size
            kv_total = self.total_num_kv_heads * self.head_size
            for sid, offset, size in (
                ("q", 0, q_total),
                ("k", q_total, kv_total),
                ("v", q_total + kv_total, kv_total),
            ):
                self.weight_loader(param, narrow_weight(loaded, 0, offset, size), sid)
            return
        if shard_id == "q":
            offset, size, head_rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, head_rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"unknown QKV shard id {shard_id!r}")
        copy_weight(param.data.narrow(0, offset, size), narrow_weight(loaded, 0, head_rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed by an all-reduce.

    The bias is added on rank 0 only, before the reduction, so that it is counted once whether
    this layer reduces (`reduce_results=True`) or leaves the sum to the caller.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        *,
        quant_config: Fp8Config | None = None,
        prefix: str = "",
    ):
        tp_size = get_tp_group().world_size
        input_size_per_rank = divide(input_size, tp_size, "input size")
        super().__init__(
            input_size_per_rank, output_size, bias, self.weight_loader, quant_config=quant_config, prefix=prefix
        )
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results

    def input_shard(self) -> tuple[int, int]:
        return self.tp_rank * self.input_size, self.input_size

    def checkpoint_input_size(self) -> int:
        return self.input_size * self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        if len(weight_shape(loaded)) == 1:  # the bias is not split
            default_weight_loader(param, loaded)
            return
        shard_size = param.shape[1]
        copy_weight(param.data, narrow_weight(loaded, 1, self.tp_rank * shard_size, shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size, self.input_size)  # [num_tokens, input_size / tp]
        bias = self.bias if self.tp_rank == 0 else None
        y = self.linear_method.apply(self, x, bias)  # [num_tokens, output_size], partial sum over ranks
        return get_tp_group().all_reduce(y) if self.reduce_results else y

    def forward_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for this rank's gate_up [num_tokens, 2 * input_size] = [gate, up]
        (a SwiGLU MLP's activation and down projection): one fused kernel where the linear method
        has one for these rows (the gemv kernel at batch 1), else silu_and_mul and forward."""
        if not self.input_is_parallel:
            raise ValueError("forward_swiglu takes this rank's gate and up halves (input_is_parallel=True)")
        bias = self.bias if self.tp_rank == 0 else None
        y = self.linear_method.apply_swiglu(self, gate_up, bias)
        if y is None:
            return self(silu_and_mul(gate_up))
        return get_tp_group().all_reduce(y) if self.reduce_results else y
