"""`NcclTransport`: KV transfers between GPUs of different processes or nodes, over NCCL through
CuPy, pulled by the decode side.

The prefill side gathers the request's blocks into one device buffer, keeps it, and publishes a
descriptor (`<id>.nccl` in `SHOAL_KV_TRANSFER_DIR`: layout, block count, and the name of its pull
server). The decode side, to load, makes an NCCL unique id (it is rank 0 and hosts the
bootstrap), leaves a pull request for that server, and joins a two-rank communicator with it;
the prefill worker's pull server (a thread) joins as rank 1, sends the buffer and frees it. The
join is bounded by the transfer's timeout (a prefill engine that died never joins). Across nodes
the transfer directory must be on a filesystem both see.

One communicator per transfer keeps the protocol stateless (either side may die between two
transfers); its set-up costs a few milliseconds to tens of them, which a long prompt's transfer
amortizes. Neither side's compute stream waits: the copy runs on the pull server's own stream.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path

import msgspec
import torch

from shoal import envs
from shoal.kv_transfer.layout import KVLayout
from shoal.kv_transfer.params import DEFAULT_TRANSFER_TIMEOUT_S, KVTransferError, KVTransferTimeout
from shoal.kv_transfer.shm_transport import transfer_path
from shoal.kv_transfer.transport import KVTransport

logger = logging.getLogger(__name__)

_POLL_S = 0.001


class _Descriptor(msgspec.Struct, array_like=True):
    layout: KVLayout
    num_blocks: int
    num_bytes: int
    server: str


class _Pull(msgspec.Struct, array_like=True):
    transfer_id: str
    unique_id: bytes


class NcclTransport(KVTransport):
    def __init__(
        self, device: torch.device, directory: str | None = None, keep_alive_s: float = 3 * DEFAULT_TRANSFER_TIMEOUT_S
    ) -> None:
        self.device = device
        self.directory = Path(directory or envs.SHOAL_KV_TRANSFER_DIR)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep_alive_s = keep_alive_s
        self.server = f"{socket.gethostname()}-{os.getpid()}-{device.index}"
        self._exported: dict[str, tuple[torch.Tensor, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pull_dir(self, server: str) -> Path:
        path = self.directory / f"pulls-{server}"
        path.mkdir(exist_ok=True)
        return path

    # ---- prefill side -----------------------------------------------------------------------------

    def save(self, transfer_id: str, layout: KVLayout, blocks: list[torch.Tensor]) -> None:
        buffer = torch.cat([b.contiguous().view(torch.uint8).flatten() for b in blocks])
        torch.cuda.current_stream(self.device).synchronize()  # gathered before the server sends it
        with self._lock:
            self._exported[transfer_id] = (buffer, time.monotonic() + self.keep_alive_s)
        descriptor = _Descriptor(layout, blocks[0].shape[1], buffer.numel(), self.server)
        final = transfer_path(self.directory, transfer_id).with_suffix(".nccl")
        partial = final.with_suffix(".tmp")
        partial.write_bytes(msgspec.msgpack.encode(descriptor))
        os.replace(partial, final)
        self._ensure_server()

    def _ensure_server(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve_pulls, name="shoal-kv-pull-server", daemon=True)
            self._thread.start()

    def _serve_pulls(self) -> None:
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        pulls = self._pull_dir(self.server)
        while not self._stop.is_set():
            for path in sorted(pulls.glob("*.pull")):
                with contextlib.suppress(Exception):
                    pull = msgspec.msgpack.decode(path.read_bytes(), type=_Pull)
                    path.unlink(missing_ok=True)
                    self._send(pull, stream)
            self._sweep()
            time.sleep(_POLL_S)

    def _send(self, pull: _Pull, stream: torch.cuda.Stream) -> None:
        from shoal.distributed.communicator import CupyNcclCommunicator

        with self._lock:
            exported = self._exported.pop(pull.transfer_id, None)
        if exported is None:
            logger.warning("pull of unknown transfer %s", pull.transfer_id)
            return
        buffer, _ = exported
        with torch.cuda.stream(stream):
            comm = CupyNcclCommunicator(pull.unique_id, 1, 2, self.device)
            try:
                comm.send(buffer, 0)
                stream.synchronize()
            finally:
                comm.destroy()

    def _sweep(self) -> None:
        """Buffers no decode engine pulled within the keep-alive go (it died, or gave up)."""
        now = time.monotonic()
        with self._lock:
            for transfer_id, (_, deadline) in list(self._exported.items()):
                if now >= deadline:
                    del self._exported[transfer_id]

    # ---- decode side ------------------------------------------------------------------------------

    def load(self, transfer_id: str, layout: KVLayout, timeout_s: float) -> list[torch.Tensor]:
        from shoal.distributed.communicator import CupyNcclCommunicator, nccl_unique_id

        deadline = time.monotonic() + timeout_s
        path = transfer_path(self.directory, transfer_id).with_suffix(".nccl")
        while not path.exists():
            if time.monotonic() >= deadline:
                raise KVTransferTimeout(f"transfer {transfer_id} did not arrive within {timeout_s:g} s")
            time.sleep(_POLL_S)
        descriptor = msgspec.msgpack.decode(path.read_bytes(), type=_Descriptor)
        layout.check_matches(descriptor.layout)
        unique_id = nccl_unique_id()
        request = self._pull_dir(descriptor.server) / f"{transfer_id}.pull"
        request.write_bytes(msgspec.msgpack.encode(_Pull(transfer_id, bytes(unique_id))))
        joined: list[CupyNcclCommunicator] = []
        # NCCL's set-up blocks until the peer joins: bounded here by the transfer's deadline.
        join = threading.Thread(target=lambda: joined.append(CupyNcclCommunicator(unique_id, 0, 2, self.device)))
        join.start()
        join.join(max(0.0, deadline - time.monotonic()))
        if not joined:
            request.unlink(missing_ok=True)
            raise KVTransferTimeout(f"the prefill side of transfer {transfer_id} did not join within {timeout_s:g} s")
        comm = joined[0]
        buffer = torch.empty(descriptor.num_bytes, dtype=torch.uint8, device=self.device)
        try:
            comm.recv(buffer, 1)
            torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:
            raise KVTransferError(f"transfer {transfer_id} failed: {exc}") from exc
        finally:
            comm.destroy()
        return _views(buffer, layout, descriptor.num_blocks)

    def release(self, transfer_id: str) -> None:
        with contextlib.suppress(OSError, KVTransferError):
            transfer_path(self.directory, transfer_id).with_suffix(".nccl").unlink(missing_ok=True)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._exported.clear()


def _views(buffer: torch.Tensor, layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    dtype = getattr(torch, layout.dtype)
    blocks, offset = [], 0
    for layer in range(len(layout.layers)):
        num_bytes = layout.layer_block_bytes(layer) * num_blocks
        blocks.append(buffer[offset : offset + num_bytes].view(dtype).view(layout.block_shape(layer, num_blocks)))
        offset += num_bytes
    return blocks
