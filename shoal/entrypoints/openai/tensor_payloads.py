"""Named tensors as SGLang's and vLLM's trainers send them over HTTP: base64 of a pickle made
by `multiprocessing.reduction.ForkingPickler` with torch's reductions, the tensors' memory
shared rather than copied (CUDA IPC handles on a GPU; on a CPU, shared-memory files when the
trainer uses torch's "file_system" sharing strategy).

Two payloads (SGLang's `load_format`):
- `None` / `"direct"`: a list of (name, tensor) pairs;
- `"flattened_bucket"`: `{"flattened_tensor": uint8 [num_bytes], "metadata": [m, ...]}`, each
  `m` (SGLang's `FlattenedTensorMetadata`) naming a tensor by `name`, `shape`, `dtype` and its
  bytes `start_idx:end_idx`.

vLLM's "ipc" weight transfer sends `update_info.ipc_handles_pickled`: base64 of a plain pickle
of one `{device_uuid: (rebuild function, args)}` per tensor (`torch.multiprocessing.reductions.
reduce_tensor`; a CPU tensor's storage then travels by value), or of one such dict for a packed
tensor that `sizes` cut in order.

A pickle can run any code, so these are read by an unpickler that rebuilds only what torch's
reductions and those payloads need (torch's tensor and storage rebuilders, a storage's bytes
through `torch.load(weights_only=True)`, dtypes, `Size`, the metadata records) and refuses every
other global: a payload that names one is a ValueError. A rebuild function is called only if it
is one of torch's.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from typing import Any

import torch

_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}
_FD_SHARING = ("torch.multiprocessing.reductions", "rebuild_storage_fd")


class TensorMetadata:
    """SGLang's `FlattenedTensorMetadata` as its pickle rebuilds it (name, shape, dtype,
    start_idx, end_idx, numel), whatever module the trainer's class lives in."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int


def _storage_from_bytes(data: bytes) -> Any:
    """A storage pickled by value (torch's `_load_from_bytes`), read without running code."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "FlattenedTensorMetadata":
            return TensorMetadata
        if (module, name) == _FD_SHARING:
            raise ValueError(
                "the tensors are shared by file descriptor, which only a child process can open: share CPU "
                "tensors with torch.multiprocessing.set_sharing_strategy('file_system') before serializing"
            )
        raise ValueError(f"the payload names {module}.{name}, which is not a tensor: refused")


LOAD_FORMATS = (None, "direct", "flattened_bucket")


def check_load_format(load_format: Any) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; SGLang's are null, 'direct', 'flattened_bucket'")


def load_payload(serialized: str | bytes) -> Any:
    """Unpickle one serialized payload (base64 text, as SGLang's `output_str=True`, or bytes)."""
    try:
        raw = base64.b64decode(serialized, validate=True) if isinstance(serialized, str) else serialized
    except (binascii.Error, ValueError):
        raise ValueError("a serialized payload is not base64") from None
    try:
        return _TensorUnpickler(io.BytesIO(raw)).load()
    except ValueError:
        raise
    except Exception as exc:  # a truncated pickle, memory the trainer no longer shares, no CUDA here
        raise ValueError(f"the payload cannot be read: {type(exc).__name__}: {exc}") from None


def named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an unpickled payload of `load_format`."""
    if load_format in (None, "direct"):
        return _direct(payload)
    check_load_format(load_format)
    return _flattened(payload)


def _direct(payload: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(payload, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in payload
    ):
        raise ValueError("a direct payload must be a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in payload]


def _flattened(payload: Any) -> list[tuple[str, torch.Tensor]]:
    flat = payload.get("flattened_tensor") if isinstance(payload, dict) else None
    metadata = payload.get("metadata") if isinstance(payload, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise ValueError("a flattened_bucket payload must be {'flattened_tensor': a 1-D tensor, 'metadata': [...]}")
    # Indices count bytes of a uint8 bucket (SGLang's buckets of several dtypes), else elements of
    # the bucket's one dtype (its earlier buckets).
    by_bytes = flat.dtype == torch.uint8
    tensors = []
    for m in metadata:
        if not isinstance(m, TensorMetadata) or not isinstance(getattr(m, "dtype", None), torch.dtype):
            raise ValueError("flattened_bucket metadata must be FlattenedTensorMetadata records")
        shape = [int(d) for d in m.shape]
        start, end = int(m.start_idx), int(m.end_idx)
        size = math.prod(shape) * (m.dtype.itemsize if by_bytes else 1)
        fits = 0 <= start <= end <= flat.numel() and end - start == size and (by_bytes or m.dtype == flat.dtype)
        if not fits:
            raise ValueError(
                f"{m.name!r}: {start}:{end} of the bucket does not hold a {m.dtype} tensor of shape {shape}"
            )
        part = flat[start:end]
        tensors.append((str(m.name), (part.view(m.dtype) if by_bytes else part).view(shape)))
    return tensors


def vllm_ipc_tensors(update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a vLLM "ipc" `update_info` (names, dtype_names, shapes,
    ipc_handles_pickled; `sizes` when packed)."""
    names, dtypes, shapes = update_info.get("names"), update_info.get("dtype_names"), update_info.get("shapes")
    handles = load_payload(update_info.get("ipc_handles_pickled") or "")
    if isinstance(handles, dict):  # packed: one tensor, cut by `sizes` (elements) in order
        sizes = update_info.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(names):
            raise ValueError("a packed ipc update needs sizes, one per name")
        flat = _rebuild(handles).flatten()
        parts = flat.split([int(n) for n in sizes]) if sum(sizes) == flat.numel() else None
        if parts is None:
            raise ValueError(f"the packed tensor has {flat.numel()} elements, sizes add up to {sum(sizes)}")
        tensors = list(parts)
    elif isinstance(handles, list) and len(handles) == len(names):
        tensors = [_rebuild(h) for h in handles]
    else:
        raise ValueError("ipc_handles_pickled must hold one handle per name, or one packed handle")
    out = []
    for name, dtype, shape, tensor in zip(names, dtypes, shapes, tensors, strict=True):
        if str(tensor.dtype).removeprefix("torch.") != dtype or tensor.numel() != math.prod(shape):
            raise ValueError(
                f"{name!r}: the handle holds {tensor.dtype} x {tensor.numel()}, update_info says {dtype} {shape}"
            )
        out.append((str(name), tensor.view(shape)))
    return out


def _rebuild(handle: Any) -> torch.Tensor:
    """One `{device: (function, args)}` handle: the only device's (or "cpu"'s) tensor."""
    if not isinstance(handle, dict) or not handle:
        raise ValueError("an ipc handle must be {device uuid: (rebuild function, args)}")
    entry = handle["cpu"] if "cpu" in handle else next(iter(handle.values())) if len(handle) == 1 else None
    if entry is None:
        raise ValueError(f"handles for {len(handle)} devices: send the one of the engine's device")
    function, args = entry
    if getattr(function, "__module__", None) != "torch.multiprocessing.reductions":
        raise ValueError("an ipc handle's function must be one of torch's rebuilders")
    tensor = function(*args)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("an ipc handle did not rebuild a tensor")
    return tensor
