"""`KVTransport`: how a request's KV blocks leave a prefill engine's worker and reach a decode
engine's worker, and the worker-side calls that use it (`save_blocks`, `load_blocks`).

A transfer is named by its `transfer_id` (with the tensor-parallel rank appended: each rank moves
its own shard). The prefill side gathers the request's blocks out of its KV cache and publishes
them (`save`); the decode side pulls them (`load`, waiting at most `timeout_s`), copies the
blocks it needs into its own newly allocated blocks, and releases the transfer (`release`).
Every failure is a `KVTransferError` (`KVTransferTimeout` when nothing came in time).

Transports: `SharedMemoryTransport` (CPU; one node: files on a tmpfs, published by an atomic
rename), `CudaIpcTransport` (processes on one GPU: the gathered blocks stay on the device, a CUDA
IPC handle travels), `NcclTransport` (GPUs of different processes or nodes: the decode side
pulls over NCCL through CuPy). `make_transport` picks by device.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from shoal import envs
from shoal.kv_transfer.layout import KVLayout, LayerLayout

if TYPE_CHECKING:
    from shoal.kv_transfer.background_loads import CopyGate
    from shoal.layers.kv_cache_spec import KVCacheSpec

logger = logging.getLogger(__name__)


class KVTransport(abc.ABC):
    @abc.abstractmethod
    def save(self, transfer_id: str, layout: KVLayout, blocks: list[torch.Tensor]) -> None:
        """Publish `blocks` (per layer `[num_parts, num_blocks, block_size, heads, head_size]`)."""

    @abc.abstractmethod
    def load(self, transfer_id: str, layout: KVLayout, timeout_s: float) -> list[torch.Tensor]:
        """The published blocks, per layer, once they are there (at most `timeout_s`)."""

    @abc.abstractmethod
    def release(self, transfer_id: str) -> None:
        """The transfer is over (loaded, or given up): its resources go. Never raises."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release whatever this process still publishes."""


def make_transport(device: torch.device, kind: str | None = None) -> KVTransport:
    """`kind`: "shm", "cuda_ipc" or "nccl" (SHOAL_KV_TRANSPORT); by default CUDA IPC on GPU
    (engines sharing a host's GPUs), shared memory on CPU."""
    kind = kind or envs.SHOAL_KV_TRANSPORT or ("cuda_ipc" if device.type == "cuda" else "shm")
    if kind == "nccl":
        from shoal.kv_transfer.nccl_transport import NcclTransport

        return NcclTransport(device)
    if kind == "cuda_ipc":
        from shoal.kv_transfer.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    if kind != "shm":
        raise ValueError(f"SHOAL_KV_TRANSPORT must be shm, cuda_ipc or nccl, got {kind!r}")
    from shoal.kv_transfer.shm_transport import SharedMemoryTransport

    return SharedMemoryTransport()


def kv_layout(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> KVLayout:
    """The layout of a worker's KV cache, from its attention layers' specs."""
    return KVLayout(
        layers=[LayerLayout(s.num_parts, s.num_kv_heads, s.head_size) for s in specs],
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
        element_size=torch.empty((), dtype=dtype).element_size(),
    )


def save_blocks(
    transport: KVTransport, transfer_id: str, layout: KVLayout, kv_caches: list[torch.Tensor], block_ids: list[int]
) -> None:
    """Gather the blocks `block_ids` of every layer's cache and publish them."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    transport.save(transfer_id, layout, [cache.index_select(1, index) for cache in kv_caches])


def load_blocks(
    transport: KVTransport,
    transfer_id: str,
    layout: KVLayout,
    kv_caches: list[torch.Tensor],
    first_block: int,
    block_ids: list[int],
    timeout_s: float,
    gate: CopyGate | None = None,
) -> None:
    """Copy the transfer's blocks [first_block, first_block + len(block_ids)) into this worker's
    blocks `block_ids`, then release the transfer (also when the copy fails). With a `gate`
    (a load in the background), the copy happens only while it is open: a load cancelled
    before its transfer arrived writes nothing."""
    from shoal.kv_transfer.params import KVTransferError

    try:
        blocks = transport.load(transfer_id, layout, timeout_s)
        end = first_block + len(block_ids)
        if blocks[0].shape[1] < end:
            raise KVTransferError(f"transfer {transfer_id} holds {blocks[0].shape[1]} blocks, {end} are needed")
        with gate.open() if gate is not None else contextlib.nullcontext(True) as may_copy:
            if may_copy:
                _copy_into(kv_caches, blocks, first_block, block_ids)
    finally:
        transport.release(transfer_id)


def _copy_into(
    kv_caches: list[torch.Tensor], blocks: list[torch.Tensor], first_block: int, block_ids: list[int]
) -> None:
    end = first_block + len(block_ids)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for cache, layer_blocks in zip(kv_caches, blocks, strict=True):
        cache.index_copy_(1, index, layer_blocks[:, first_block:end].to(cache.device, non_blocking=True))
    if kv_caches[0].device.type == "cuda":
        torch.cuda.current_stream().synchronize()  # the source may go once this returns
