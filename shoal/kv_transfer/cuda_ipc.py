"""`CudaIpcTransport`: KV transfers between processes on one GPU (a prefill and a decode engine
sharing it, each with its share of the memory).

The prefill side gathers the request's blocks into one device buffer and keeps it; a small
descriptor (`<id>.ipc` in `SHOAL_KV_TRANSFER_DIR`, msgpack: the buffer's CUDA IPC handle and the
header) is published by an atomic rename. The decode side polls for the descriptor until its
timeout, opens the handle, copies its blocks device to device, and acknowledges (`<id>.ack`).
The prefill side frees a buffer once acknowledged, or when its keep-alive runs out (a decode
engine that died never acknowledges): checked on every save and at close.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from shoal import envs
from shoal.kv_transfer.layout import KVLayout
from shoal.kv_transfer.params import DEFAULT_TRANSFER_TIMEOUT_S, KVTransferError, KVTransferTimeout
from shoal.kv_transfer.shm_transport import transfer_path
from shoal.kv_transfer.transport import KVTransport

_POLL_S = 0.001


class _Descriptor(msgspec.Struct, array_like=True):
    layout: KVLayout
    num_blocks: int
    ipc: dict[str, Any]


class CudaIpcTransport(KVTransport):
    def __init__(self, directory: str | None = None, keep_alive_s: float = 3 * DEFAULT_TRANSFER_TIMEOUT_S) -> None:
        self.directory = Path(directory or envs.SHOAL_KV_TRANSFER_DIR)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_alive_s = keep_alive_s
        # transfer id -> (the published buffer, when it may go even unacknowledged)
        self._exported: dict[str, tuple[torch.Tensor, float]] = {}

    def _path(self, transfer_id: str, suffix: str) -> Path:
        return transfer_path(self.directory, transfer_id).with_suffix(suffix)

    def save(self, transfer_id: str, layout: KVLayout, blocks: list[torch.Tensor]) -> None:
        from shoal.rl.tensor_transfer import cuda_ipc_handle

        self._sweep()
        buffer = torch.cat([b.contiguous().view(torch.uint8).flatten() for b in blocks])
        torch.cuda.current_stream().synchronize()  # gathered before another process reads it
        self._exported[transfer_id] = (buffer, time.monotonic() + self.keep_alive_s)
        descriptor = _Descriptor(layout, blocks[0].shape[1], cuda_ipc_handle(buffer))
        partial = self._path(transfer_id, ".tmp")
        partial.write_bytes(msgspec.msgpack.encode(descriptor))
        os.replace(partial, self._path(transfer_id, ".ipc"))

    def load(self, transfer_id: str, layout: KVLayout, timeout_s: float) -> list[torch.Tensor]:
        from shoal.rl.tensor_transfer import open_cuda_ipc_handle

        path = self._path(transfer_id, ".ipc")
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() >= deadline:
                raise KVTransferTimeout(f"transfer {transfer_id} did not arrive within {timeout_s:g} s")
            time.sleep(_POLL_S)
        try:
            descriptor = msgspec.msgpack.decode(path.read_bytes(), type=_Descriptor)
            buffer = open_cuda_ipc_handle(descriptor.ipc)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, RuntimeError) as exc:
            raise KVTransferError(f"transfer {transfer_id} cannot be opened: {exc}") from exc
        layout.check_matches(descriptor.layout)
        dtype = getattr(torch, layout.dtype)
        blocks, offset = [], 0
        for layer in range(len(layout.layers)):
            num_bytes = layout.layer_block_bytes(layer) * descriptor.num_blocks
            blocks.append(
                buffer[offset : offset + num_bytes].view(dtype).view(layout.block_shape(layer, descriptor.num_blocks))
            )
            offset += num_bytes
        return blocks

    def release(self, transfer_id: str) -> None:
        """The decode side is done: acknowledge, so that the prefill side frees the buffer."""
        with contextlib.suppress(OSError, KVTransferError):
            self._path(transfer_id, ".ipc").unlink(missing_ok=True)
            self._path(transfer_id, ".ack").touch()

    def _sweep(self) -> None:
        now = time.monotonic()
        for transfer_id, (_, deadline) in list(self._exported.items()):
            ack = self._path(transfer_id, ".ack")
            if ack.exists() or now >= deadline:
                del self._exported[transfer_id]
                with contextlib.suppress(OSError):
                    ack.unlink(missing_ok=True)
                    self._path(transfer_id, ".ipc").unlink(missing_ok=True)

    def close(self) -> None:
        for transfer_id in list(self._exported):
            with contextlib.suppress(OSError, KVTransferError):
                self._path(transfer_id, ".ipc").unlink(missing_ok=True)
        self._exported.clear()
