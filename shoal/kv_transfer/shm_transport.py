"""`SharedMemoryTransport`: KV transfers between CPU engines of one node, through files on a
tmpfs (`SHOAL_KV_TRANSFER_DIR`, /dev/shm where there is one).

A transfer is one file: an 8-byte header length, the msgpack header (layout, block count), then
each layer's blocks, raw, layers in order. The prefill side writes `<id>.tmp` and renames it to
`<id>.kv` (atomic: a reader never sees half a transfer); the decode side polls for `<id>.kv`
until its timeout, reads it and deletes it. A transfer nobody loads is deleted by whoever gives
up on it (`release`, the proxy's `discard_transfer`).
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from pathlib import Path

import msgspec
import torch

from shoal import envs
from shoal.kv_transfer.layout import KVLayout
from shoal.kv_transfer.params import KVTransferError, KVTransferTimeout
from shoal.kv_transfer.transport import KVTransport

_POLL_S = 0.002
_SUFFIX = ".kv"


class _Header(msgspec.Struct, array_like=True):
    layout: KVLayout
    num_blocks: int


class SharedMemoryTransport(KVTransport):
    def __init__(self, directory: str | None = None) -> None:
        self.directory = Path(directory or envs.SHOAL_KV_TRANSFER_DIR)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, transfer_id: str) -> Path:
        return transfer_path(self.directory, transfer_id)

    def save(self, transfer_id: str, layout: KVLayout, blocks: list[torch.Tensor]) -> None:
        header = msgspec.msgpack.encode(_Header(layout, blocks[0].shape[1]))
        final = self.path(transfer_id)
        partial = final.with_suffix(".tmp")
        with open(partial, "wb") as file:
            file.write(struct.pack("<Q", len(header)))
            file.write(header)
            for layer_blocks in blocks:
                file.write(layer_blocks.contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(partial, final)

    def load(self, transfer_id: str, layout: KVLayout, timeout_s: float) -> list[torch.Tensor]:
        path = self.path(transfer_id)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = path.read_bytes()
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise KVTransferTimeout(f"transfer {transfer_id} did not arrive within {timeout_s:g} s") from None
                time.sleep(_POLL_S)
        return _parse(transfer_id, data, layout)

    def release(self, transfer_id: str) -> None:
        discard_transfer(self.directory, transfer_id)

    def close(self) -> None:
        """Nothing held here: a published file is the loader's (or the proxy's) to delete."""


def transfer_path(directory: Path, transfer_id: str) -> Path:
    if not transfer_id or "/" in transfer_id or transfer_id.startswith("."):
        raise KVTransferError(f"bad transfer id {transfer_id!r}")
    return directory / (transfer_id + _SUFFIX)


def discard_transfer(directory: Path | str, transfer_id: str) -> None:
    """Delete a transfer (every rank's file) that nobody will load; never raises."""
    with contextlib.suppress(OSError, KVTransferError):
        for path in Path(directory).glob(transfer_id + "*" + _SUFFIX):
            path.unlink(missing_ok=True)


def _parse(transfer_id: str, data: bytes, layout: KVLayout) -> list[torch.Tensor]:
    try:
        (header_bytes,) = struct.unpack_from("<Q", data)
        header = msgspec.msgpack.decode(data[8 : 8 + header_bytes], type=_Header)
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVTransferError(f"transfer {transfer_id} is malformed: {exc}") from exc
    layout.check_matches(header.layout)
    payload = torch.frombuffer(bytearray(data[8 + header_bytes :]), dtype=torch.uint8)
    dtype = getattr(torch, layout.dtype)
    blocks, offset = [], 0
    for layer in range(len(layout.layers)):
        num_bytes = layout.layer_block_bytes(layer) * header.num_blocks
        if offset + num_bytes > payload.numel():
            raise KVTransferError(f"transfer {transfer_id} is truncated")
        raw = payload[offset : offset + num_bytes]
        blocks.append(raw.view(dtype).view(layout.block_shape(layer, header.num_blocks)))
        offset += num_bytes
    return blocks
