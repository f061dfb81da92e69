"""`WeightUpdateGroup`: the stateless process group of a trainer's sending rank (rank 0) and an
engine's workers (ranks `rank_offset + worker rank`), for broadcasting new weights.

It lives outside torch.distributed's default group and outside the engine's own TP/PP groups:
built from a `TCPStore` that rank 0 hosts at `master_address:master_port`, as a gloo process
group on CPU, or on GPU as an NCCL communicator through CuPy whose unique id rank 0 puts in
the store. Building it is a collective: every rank constructs it at the same time (the trainer's
call blocks until the engine's workers have joined).

A group with a `group_name` is the one SGLang's trainers build instead (SGLang, AReaL, slime,
OpenRLHF: torch's `tcp://` rendezvous, a store prefixed by the group's name, a torch process
group of gloo or NCCL), so that their broadcasts reach shoal unchanged; its tensors then travel
one broadcast each, in the order of the update's names, rather than in shoal's buckets.
"""

from __future__ import annotations

import datetime
import json
import logging

import torch
import torch.distributed as dist

from shoal.distributed.communicator import Communicator, CupyNcclCommunicator, NcclUniqueId, nccl_unique_id

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 600.0
_UNIQUE_ID_KEY = "shoal/weight_update/nccl_unique_id"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """gloo on a CPU, NCCL on a GPU, unless `backend` says which."""
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs CUDA devices; use backend='gloo' on a CPU")
    return backend


class WeightUpdateGroup:
    """Broadcasts over `world_size` ranks: the trainer (rank 0) and the engine's workers."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group_name: str | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a weight-update group of world_size={world_size}")
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = resolve_backend(backend, device)
        self.group_name = group_name
        timeout = datetime.timedelta(seconds=timeout_s)
        self._process_group: dist.ProcessGroup | None = None
        self._nccl: Communicator | None = None
        if group_name is not None:
            self._process_group = _torch_group(
                master_address, int(master_port), rank, world_size, self.backend, group_name, timeout
            )
        else:
            self.store = dist.TCPStore(
                master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout
            )
            if self.backend == "gloo":
                self._process_group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
            else:
                self._nccl = CupyNcclCommunicator(self._exchange_unique_id(), rank, world_size, device)
        logger.info(
            "joined the weight-update group %s as rank %d of %d (%s)", group_name or "", rank, world_size, self.backend
        )

    @property
    def per_tensor(self) -> bool:
        """Whether tensors arrive one broadcast each (SGLang's protocol) rather than in buckets."""
        return self.group_name is not None

    def _exchange_unique_id(self) -> NcclUniqueId:
        """Rank 0 creates the NCCL id (and hosts NCCL's bootstrap); the others read it."""
        if self.rank == 0:
            unique_id = nccl_unique_id()
            encoded = bytes(unique_id) if isinstance(unique_id, bytes) else json.dumps(list(unique_id)).encode()
            self.store.set(_UNIQUE_ID_KEY, (b"b" if isinstance(unique_id, bytes) else b"t") + encoded)
            return unique_id
        raw = self.store.get(_UNIQUE_ID_KEY)
        return raw[1:] if raw[:1] == b"b" else tuple(json.loads(raw[1:]))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`tensor` of rank `src` into `tensor` on every rank (contiguous, on this group's device)."""
        if self._process_group is not None:
            options = dist.BroadcastOptions()
            options.rootRank = src
            self._process_group.broadcast([tensor], options).wait()
            return tensor
        assert self._nccl is not None
        return self._nccl.broadcast(tensor, src)

    def destroy(self) -> None:
        """Leave the group (every rank does, when the transfers are over)."""
        if self._nccl is not None:
            self._nccl.destroy()
        if self._process_group is not None and self.group_name is not None:
            dist.destroy_process_group(self._process_group)  # its name may be used again
        self._nccl = None
        self._process_group = None


def _torch_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """The process group SGLang's `init_custom_process_group` builds on every rank (the trainer's
    and the engine's), outside torch.distributed's default group: rank 0 hosts the rendezvous
    store, whose keys are prefixed by the group's name."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
        group_desc=group_name,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
