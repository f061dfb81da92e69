"""Install a fake tensor-parallel group (no communicator): enough to build layers and check
which shard each rank loads, without running collectives."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shoal.distributed import parallel_state
from shoal.distributed.parallel_state import GroupCoordinator, set_model_parallel_groups


@contextmanager
def fake_tp_group(rank: int, world_size: int = 2) -> Iterator[GroupCoordinator]:
    previous = parallel_state._TP, parallel_state._PP
    group = GroupCoordinator(ranks=list(range(world_size)), rank_in_group=rank)
    set_model_parallel_groups(group, None)
    try:
        yield group
    finally:
        set_model_parallel_groups(*previous)


@contextmanager
def fake_pp_group(rank: int, world_size: int) -> Iterator[GroupCoordinator]:
    previous = parallel_state._TP, parallel_state._PP
    group = GroupCoordinator(ranks=list(range(world_size)), rank_in_group=rank)
    set_model_parallel_groups(None, group)
    try:
        yield group
    finally:
        set_model_parallel_groups(*previous)
