"""`Communicator`: the collectives of one group of ranks, with one backend per device.

- `GlooCommunicator` (CPU): torch.distributed with the gloo backend over a subgroup of the
  world that `parallel_state.init_distributed_environment` created.
- `CupyNcclCommunicator` (GPU): NCCL through CuPy (`cupy.cuda.nccl.NcclCommunicator`), called
  with raw device pointers on `torch.cuda.current_stream()`. It needs no torch.distributed
  process group, so it also serves groups formed outside the engine (trainer → engine weight
  transfer), and its calls can be captured in a CUDA graph (NCCL >= 2.9.6): a captured NCCL
  kernel runs on whatever stream is current during capture.

Ranks passed to `send`, `recv` and `broadcast` are positions in the group (0 .. world_size-1),
never global ranks.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Communicator(ABC):
    """Sum all-reduce, all-gather, broadcast and point-to-point over one group."""

    def __init__(self, rank_in_group: int, world_size: int) -> None:
        self.rank_in_group = rank_in_group
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group (may reduce `tensor` in place and return it)."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` concatenated along `dim`, in rank order."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """`tensor` of rank `src`, copied into `tensor` on every other rank."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst`, which must post a `recv` of the same shape and dtype."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `tensor` with what rank `src` sends; returns it."""

    def destroy(self) -> None:
        """Release the backend's resources (the group is unusable afterwards)."""
        return None


def concat_gathered(gathered: list[torch.Tensor], dim: int) -> torch.Tensor:
    """[rank 0's tensor, rank 1's, ...] → one tensor, concatenated along `dim`."""
    return torch.cat(gathered, dim=dim)


class GlooCommunicator(Communicator):
    """torch.distributed over a gloo subgroup (CPU tensors)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor, group=self.group)
        return concat_gathered(gathered, dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, group=self.group, group_src=src)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), group=self.group, group_dst=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, group=self.group, group_src=src)
        return tensor


def _nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    """The ncclDataType_t value of a torch dtype. CuPy has no bfloat16 constant; NCCL (>= 2.10)
    numbers it 9."""
    names = {
        torch.int8: "NCCL_INT8",
        torch.uint8: "NCCL_UINT8",
        torch.int32: "NCCL_INT32",
        torch.int64: "NCCL_INT64",
        torch.float16: "NCCL_FLOAT16",
        torch.float32: "NCCL_FLOAT32",
        torch.float64: "NCCL_FLOAT64",
    }
    if dtype == torch.bfloat16:
        return int(getattr(nccl, "NCCL_BFLOAT16", 9))
    if dtype not in names:
        raise TypeError(f"NCCL cannot communicate {dtype}")
    return int(getattr(nccl, names[dtype]))


# An NCCL unique id: 128 bytes (CuPy >= 14 gives bytes, older CuPy a tuple of ints).
NcclUniqueId = bytes | tuple[int, ...]


def nccl_unique_id() -> NcclUniqueId:
    """A new NCCL unique id. The process that creates it hosts the group's bootstrap, so rank 0
    of the group must create it and stay alive."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


class CupyNcclCommunicator(Communicator):
    """NCCL through CuPy, on the current torch CUDA stream (works inside CUDA-graph capture).

    Every rank of the group constructs one with the same `unique_id` at the same time (the
    constructor is itself a collective).
    """

    def __init__(self, unique_id: NcclUniqueId, rank_in_group: int, world_size: int, device: torch.device) -> None:
        super().__init__(rank_in_group, world_size)
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = device
        with cupy.cuda.Device(device.index):
            self._comm = nccl.NcclCommunicator(world_size, unique_id, rank_in_group)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(f"tensor on {tensor.device}, but this NCCL group is on {self.device}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        tensor = tensor.contiguous()
        dtype = _nccl_dtype(self._nccl, tensor.dtype)
        ptr = tensor.data_ptr()
        self._comm.allReduce(ptr, ptr, tensor.numel(), dtype, self._nccl.NCCL_SUM, self._stream())
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._check(tensor)
        tensor = tensor.contiguous()
        output = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        dtype = _nccl_dtype(self._nccl, tensor.dtype)
        self._comm.allGather(tensor.data_ptr(), output.data_ptr(), tensor.numel(), dtype, self._stream())
        return concat_gathered(list(output.unbind(0)), dim)  # output: [world_size, *tensor.shape]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._check(tensor)
        if not tensor.is_contiguous():
            raise ValueError("NCCL broadcast needs a contiguous tensor (it writes in place)")
        dtype = _nccl_dtype(self._nccl, tensor.dtype)
        ptr = tensor.data_ptr()
        self._comm.broadcast(ptr, ptr, tensor.numel(), dtype, src, self._stream())
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._check(tensor)
        tensor = tensor.contiguous()
        dtype = _nccl_dtype(self._nccl, tensor.dtype)
        self._comm.send(tensor.data_ptr(), tensor.numel(), dtype, dst, self._stream())

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._check(tensor)
        if not tensor.is_contiguous():
            raise ValueError("NCCL recv needs a contiguous tensor (it writes in place)")
        dtype = _nccl_dtype(self._nccl, tensor.dtype)
        self._comm.recv(tensor.data_ptr(), tensor.numel(), dtype, src, self._stream())
        return tensor

    def destroy(self) -> None:
        """Free the NCCL communicator. CUDA graphs that captured its calls must be gone first:
        NCCL waits for them to be destroyed."""
        self._comm.destroy()
