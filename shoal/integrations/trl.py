"""TRL's async GRPO with shoal's trainer-side weight sender: a `weight_transfer` for
`trl.experimental.async_grpo.AsyncGRPOTrainer` (TRL's `WeightTransferProtocol`).

TRL's default `WeightTransferClient` needs vLLM on the trainer's side (vLLM's NCCL rendezvous
and packed producer). This one speaks the same four-phase HTTP transfer to `shoal serve
--enable-rl-endpoints` through TRL's own `VLLMClient`, and broadcasts with
`shoal.rl.WeightSender` (gloo on a CPU, NCCL on a GPU):

    client = VLLMClient("http://127.0.0.1:30000")
    trainer = AsyncGRPOTrainer(..., weight_transfer=ShoalWeightTransfer(client, "10.0.0.1"))

`send_weights` streams TRL's (name, tensor) iterator in chunks of `bucket_bytes`, one
`/update_weights` per chunk, so the trainer never holds more than one chunk beyond its model.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shoal.rl import DEFAULT_BUCKET_BYTES, WeightSender

logger = logging.getLogger(__name__)


class ShoalWeightTransfer:
    """`vllm_client`: TRL's `VLLMClient` of the server (any object with its methods);
    `master_address`: this trainer's address as the server's workers reach it."""

    def __init__(
        self,
        vllm_client: Any,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: int = 1800,
    ) -> None:
        self.vllm = vllm_client
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.sender: WeightSender | None = None

    def init_weight_transfer(self) -> None:
        """Join the server's workers in a weight-update group (this trainer is rank 0)."""
        self.vllm.wait_for_server_ready()
        world_size = self.vllm.get_world_size() + 1
        port = self.master_port or _free_port()
        init_info = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
        }
        with ThreadPoolExecutor(1) as pool:  # both sides block until the other has joined
            joined = pool.submit(WeightSender, self.master_address, port, world_size, self.backend, self.bucket_bytes)
            self.vllm.init_weight_transfer_engine(init_info, timeout=self.timeout_s)
            self.sender = joined.result(timeout=self.timeout_s)

    def pause(self) -> None:
        self.vllm.pause()

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """start, one `/update_weights` per chunk (its broadcast beside it), finish."""
        if self.sender is None:
            raise RuntimeError("call init_weight_transfer() first")
        self.vllm.start_weight_update()
        try:
            with ThreadPoolExecutor(1) as pool:
                for chunk in _chunks(iterator, self.bucket_bytes):
                    metadata = self.sender.metadata(chunk)
                    sent = pool.submit(self.sender.send, chunk)
                    self.vllm.update_weights(
                        {
                            "names": metadata["names"],
                            "dtype_names": metadata["dtypes"],
                            "shapes": metadata["shapes"],
                            "bucket_bytes": metadata["bucket_bytes"],
                        },
                        timeout=self.timeout_s,
                    )
                    sent.result(timeout=self.timeout_s)
        finally:
            self.vllm.finish_weight_update()

    def resume(self) -> None:
        self.vllm.resume()

    def destroy(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def _chunks(iterator: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs, at most `max_bytes` a chunk (a larger tensor alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in iterator:
        num_bytes = tensor.numel() * tensor.element_size()
        if chunk and size + num_bytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor.detach()))
        size += num_bytes
    if chunk:
        yield chunk


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
