"""Parallel state of one worker: its tensor-parallel and pipeline-parallel groups.

Ranks are laid out as `rank = pp_rank * tp_size + tp_rank`: a tensor-parallel group is one
pipeline stage (`tp_size` consecutive ranks), a pipeline-parallel group is the ranks of one
`tp_rank` across the stages. Before `initialize_model_parallel` runs (a single-process engine),
both groups are trivial: one rank, collectives are no-ops.

Start-up, on every worker at once: `init_distributed_environment` (the torch.distributed world,
gloo, from a tcp:// address) then `initialize_model_parallel` (the groups, each with a gloo
communicator on CPU or a CuPy NCCL one on GPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shoal.distributed.communicator import Communicator, CupyNcclCommunicator, GlooCommunicator, NcclUniqueId

logger = logging.getLogger(__name__)

# How long torch.distributed waits for every rank at start-up and in a gloo collective.
DISTRIBUTED_TIMEOUT_S = 600


@dataclass
class GroupCoordinator:
    """One process group: this rank's place in it and the collectives over it."""

    ranks: list[int]  # global ranks in the group
    rank_in_group: int
    communicator: Communicator | None = None  # None when the group has a single rank

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

    def broadcast(self, tensor: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.communicator.broadcast(tensor, src_in_group)  # type: ignore[union-attr]

    def send(self, tensor: torch.Tensor, dst_in_group: int) -> None:
        self.communicator.send(tensor, dst_in_group)  # type: ignore[union-attr]

    def recv(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        return self.communicator.recv(tensor, src_in_group)  # type: ignore[union-attr]


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
# Mixture-of-experts layers split whole experts over the TP group (enable_expert_parallel).
_EXPERT_PARALLEL = False


def get_tp_group() -> GroupCoordinator:
    return _TP or GroupCoordinator(ranks=[0], rank_in_group=0)


def get_pp_group() -> GroupCoordinator:
    return _PP or GroupCoordinator(ranks=[0], rank_in_group=0)


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def expert_parallel_enabled() -> bool:
    """Whether mixture-of-experts layers split whole experts over the tensor-parallel group
    (`enable_expert_parallel`) rather than every expert's intermediate dimension."""
    return _EXPERT_PARALLEL


def set_expert_parallel(enabled: bool) -> None:
    """Install this worker's expert-parallel choice (the distributed init does this; tests may too)."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = enabled


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


def tp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """Every tensor-parallel group: one per pipeline stage, its `tp_size` consecutive ranks."""
    return [[pp_rank * tp_size + tp_rank for tp_rank in range(tp_size)] for pp_rank in range(pp_size)]


def pp_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """Every pipeline-parallel group: one per `tp_rank`, that rank of each stage in stage order."""
    return [[pp_rank * tp_size + tp_rank for pp_rank in range(pp_size)] for tp_rank in range(tp_size)]


def init_distributed_environment(world_size: int, rank: int, init_method: str) -> None:
    """Join the torch.distributed world (gloo; `init_method` is tcp://<rank 0's ip>:<port>).
    A collective: every rank calls it at the same time."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=timedelta(seconds=DISTRIBUTED_TIMEOUT_S),
    )


def initialize_model_parallel(
    tp_size: int,
    pp_size: int,
    device: torch.device,
    nccl_unique_ids: dict[tuple[int, ...], NcclUniqueId] | None = None,
    enable_expert_parallel: bool = False,
) -> None:
    """Create this worker's tensor- and pipeline-parallel groups and install them.

    On GPU, `nccl_unique_ids` maps each group of more than one rank (its global ranks, as a
    tuple) to the NCCL unique id that the group's rank 0 created. With
    `enable_expert_parallel` the tensor-parallel group also splits MoE layers' experts.
    """
    rank = dist.get_rank()
    tp = _create_group(tp_group_ranks(tp_size, pp_size), rank, device, nccl_unique_ids)
    pp = _create_group(pp_group_ranks(tp_size, pp_size), rank, device, nccl_unique_ids)
    set_model_parallel_groups(tp, pp)
    set_expert_parallel(enable_expert_parallel)
    logger.debug("rank %d: tensor-parallel ranks %s, pipeline-parallel ranks %s", rank, tp.ranks, pp.ranks)


def _create_group(
    all_group_ranks: list[list[int]],
    rank: int,
    device: torch.device,
    nccl_unique_ids: dict[tuple[int, ...], NcclUniqueId] | None,
) -> GroupCoordinator:
    """This rank's group among `all_group_ranks`, with the communicator of its device."""
    mine: GroupCoordinator | None = None
    for ranks in all_group_ranks:
        gloo_group = None
        if device.type == "cpu" and len(ranks) > 1:
            # torch.distributed wants every rank to create every group, in the same order.
            gloo_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=DISTRIBUTED_TIMEOUT_S))
        if rank not in ranks:
            continue
        rank_in_group = ranks.index(rank)
        communicator: Communicator | None = None
        if gloo_group is not None:
            communicator = GlooCommunicator(gloo_group)
        elif len(ranks) > 1:
            if nccl_unique_ids is None or tuple(ranks) not in nccl_unique_ids:
                raise ValueError(f"no NCCL unique id for the group of ranks {ranks}")
            communicator = CupyNcclCommunicator(nccl_unique_ids[tuple(ranks)], rank_in_group, len(ranks), device)
        mine = GroupCoordinator(ranks=ranks, rank_in_group=rank_in_group, communicator=communicator)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the groups {all_group_ranks}")
    return mine


def destroy_model_parallel() -> None:
    """Release the groups' communicators and leave the torch.distributed world."""
    for group in (_TP, _PP):
        if group is not None and group.communicator is not None:
            group.communicator.destroy()
    set_model_parallel_groups(None, None)
    set_expert_parallel(False)
    if dist.is_initialized():
        dist.destroy_process_group()
