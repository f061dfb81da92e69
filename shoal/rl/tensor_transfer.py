"""How `update_weights_from_tensors` carries the caller's tensors to the engine's workers: one
bucket at a time (shoal/rl/buckets.py), as msgpack-able dicts (the utility-call path takes no
pickle).

- CPU tensors: the bucket's bytes travel in the call (`{"metas", "data"}`).
- CUDA tensors: the bucket is packed into a buffer the caller owns and keeps until the call has
  returned; a CUDA IPC handle to it travels (`{"metas", "cuda_ipc"}`). Each worker opens the
  handle on the GPU the buffer is on (found by UUID, whatever CUDA_VISIBLE_DEVICES says there),
  copies its shard into its parameters, synchronizes and lets the mapping go. A worker in the
  caller's own process (an engine with multiprocess=False) cannot open an IPC handle of its own
  process: it finds the buffer in `_LOCAL_BUFFERS` instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from shoal.rl.buckets import TensorMeta, pack, plan_buckets, tensor_meta, unpack

# Buffers of this process's CUDA buckets while their call runs, by key (see the module doc).
_LOCAL_BUFFERS: dict[int, torch.Tensor] = {}
_KEYS = itertools.count()


def plan_tensor_buckets(
    named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """`named_tensors` in consecutive buckets of at most `bucket_bytes` (see `plan_buckets`)."""
    metas = [tensor_meta(str(i), t) for i, (_, t) in enumerate(named_tensors)]
    return [[named_tensors[int(m.name)] for m in bucket] for bucket in plan_buckets(metas, bucket_bytes)]


def encode_metas(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    return [[name, meta.dtype, list(meta.shape)] for name, t in named_tensors for meta in [tensor_meta(name, t)]]


def decode_metas(encoded: Sequence[Sequence[Any]]) -> list[TensorMeta]:
    return [TensorMeta(str(name), str(dtype), tuple(int(s) for s in shape)) for name, dtype, shape in encoded]


def cpu_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    buffer = pack([t for _, t in named_tensors], "cpu")
    return {"metas": encode_metas(named_tensors), "data": buffer.numpy().tobytes()}


@contextmanager
def cuda_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> Iterator[dict[str, Any]]:
    """The bucket as a CUDA IPC handle, valid inside the block (the buffer is freed after)."""
    device = named_tensors[0][1].device
    buffer = pack([t for _, t in named_tensors], device)
    torch.cuda.synchronize(device)  # packed before another process reads it
    ipc = cuda_ipc_handle(buffer)
    key = next(_KEYS)
    _LOCAL_BUFFERS[key] = buffer
    try:
        yield {"metas": encode_metas(named_tensors), "cuda_ipc": ipc, "pid": os.getpid(), "key": key}
    finally:
        del _LOCAL_BUFFERS[key]


def cuda_ipc_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """A msgpack-able CUDA IPC handle to a device buffer (uint8), for `open_cuda_ipc_handle` in
    another process (the KV transfers share it: shoal/kv_transfer/cuda_ipc.py)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    # (tensor class, size, stride, offset, storage class, dtype, device index, handle, storage
    # bytes, storage offset, requires_grad, ref-counter handle and offset, event handle, sync)
    return {
        "device_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
        "size": list(args[1]),
        "offset": args[3],
        "handle": args[7],
        "storage_bytes": args[8],
        "storage_offset": args[9],
        "ref_counter_handle": args[11],
        "ref_counter_offset": args[12],
        "event_handle": args[13],
        "event_sync_required": args[14],
    }


def bucket_metas(bucket: dict[str, Any]) -> list[TensorMeta]:
    return decode_metas(bucket["metas"])


def open_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a bucket made by `cpu_bucket` or `cuda_bucket`."""
    metas = bucket_metas(bucket)
    if "data" in bucket:
        buffer = torch.frombuffer(bytearray(bucket["data"]), dtype=torch.uint8)
    elif bucket.get("pid") == os.getpid():
        buffer = _LOCAL_BUFFERS[bucket["key"]]
    else:
        buffer = open_cuda_ipc_handle(bucket["cuda_ipc"])
    return unpack(buffer, metas)


def open_cuda_ipc_handle(ipc: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = _device_index(ipc["device_uuid"])
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(ipc["size"]),
        (1,),
        ipc["offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        index,
        ipc["handle"],
        ipc["storage_bytes"],
        ipc["storage_offset"],
        False,
        ipc["ref_counter_handle"],
        ipc["ref_counter_offset"],
        ipc["event_handle"],
        ipc["event_sync_required"],
    )


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(f"the tensors' GPU {uuid} is not visible to this worker (CUDA IPC needs the same host and GPU)")
