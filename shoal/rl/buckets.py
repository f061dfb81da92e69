"""Weight buckets: many named tensors packed into one flat byte buffer, so that a transfer costs
one collective (or one CUDA IPC handle, or one bytes object) per bucket, not one per tensor.

The sender and the receiver plan the same buckets from the same metadata (`plan_buckets`:
greedy, in the order given), so only the buffers travel. Every tensor starts at a multiple of
`ALIGN_BYTES` inside its bucket: a view of any dtype can be taken at its offset, and device
copies stay aligned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

ALIGN_BYTES = 256

# The dtypes a weight may have, by the names that travel in metadata ("bfloat16", ...).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "int8", "uint8", "int32", "int64")
}


class TensorMeta(NamedTuple):
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("bfloat16" or "torch.bfloat16"); ValueError if none is."""
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; weights may be {sorted(DTYPES)}")
    return dtype


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def as_metas(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """The metadata of an update given as three parallel lists (vLLM's and SGLang's form)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        parse_dtype(dtype)
        if not all(isinstance(size, int) and size >= 0 for size in shape):
            raise ValueError(f"weight {name!r}: shape {list(shape)} is not a list of sizes")
        metas.append(TensorMeta(str(name), str(dtype).removeprefix("torch."), tuple(int(s) for s in shape)))
    return metas


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def bucket_offsets(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket, and the bucket's size in bytes."""
    offsets, end = [], 0
    for meta in metas:
        offsets.append(end)
        end = _aligned(end + meta.nbytes)
    return offsets, end


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive runs of `metas` of at most `bucket_bytes` each (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    current_bytes = 0
    for meta in metas:
        size = _aligned(meta.nbytes)
        if current and current_bytes + size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(meta)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def pack(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One flat uint8 buffer holding `tensors` at `bucket_offsets` (on `device`, default the
    first tensor's)."""
    metas = [tensor_meta("", t) for t in tensors]
    offsets, total = bucket_offsets(metas)
    buffer = torch.empty(total, dtype=torch.uint8, device=device or tensors[0].device)
    for tensor, offset in zip(tensors, offsets):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
    return buffer


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `buffer`) for every tensor of the bucket `metas` describes."""
    offsets, total = bucket_offsets(metas)
    if buffer.numel() < total:
        raise ValueError(f"a bucket of {buffer.numel()} bytes cannot hold the {total} its metadata describes")
    views = []
    for meta, offset in zip(metas, offsets):
        raw = buffer[offset : offset + meta.nbytes]
        views.append((meta.name, raw.view(DTYPES[meta.dtype]).reshape(meta.shape)))
    return views


def named_tensors_of(
    source: torch.nn.Module | dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a model (its parameters), a dict or an iterable of pairs."""
    if isinstance(source, torch.nn.Module):
        return [(name, param.detach()) for name, param in source.named_parameters()]
    if isinstance(source, dict):
        return list(source.items())
    return [(str(name), tensor) for name, tensor in source]
