"""Parallel state of one worker: its tensor-parallel and pipeline-parallel groups.

Ranks are laid out as `rank = pp_rank * tp_size + tp_rank`. Before `initialize_model_parallel`
runs (a single-process engine), both groups are trivial: one rank, collectives are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupCoordinator:
    """One process group: this rank's place in it and the collectives over it."""

    ranks: list[int]  # global ranks in the group
    rank_in_group: int
    communicator: object | None = None  # a shoal.distributed.communicator.Communicator

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.communicator.all_reduce(tensor)  # type: ignore[union-attr]

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.communicator.all_gather(tensor, dim)  # type: ignore[union-attr]

    def send(self, tensor: torch.Tensor, dst_in_group: int) -> None:
        self.communicator.send(tensor, dst_in_group)  # type: ignore[union-attr]

    def recv(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        return self.communicator.recv(tensor, src_in_group)  # type: ignore[union-attr]


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    return _TP or GroupCoordinator(ranks=[0], rank_in_group=0)


def get_pp_group() -> GroupCoordinator:
    return _PP or GroupCoordinator(ranks=[0], rank_in_group=0)


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def set_model_parallel_groups(tp: GroupCoordinator | None, pp: GroupCoordinator | None) -> None:
    """Install this worker's groups (the distributed init does this; tests may too)."""
    global _TP, _PP
    _TP, _PP = tp, pp


def pp_layer_range(
    num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """The contiguous slice [start, end) of decoder layers that pipeline stage `pp_rank` runs.

    Without an explicit partition the layers are split as evenly as possible, the earlier
    stages taking the remainder one layer each.
    """
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = tuple(base + (1 if i < extra else 0) for i in range(pp_size))
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]
