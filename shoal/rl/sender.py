"""`WeightSender`: the trainer's side of `update_weights_from_distributed`.

    sender = WeightSender(master_address, master_port, world_size)   # rank 0 of the group
    ...                                                              # a training step
    metadata = sender.metadata(model)      # names, dtypes, shapes, bucket_bytes: for the engine
    sender.send(model)                     # the same buckets the engine receives, in order

Constructing the sender and `send` are collectives with the engine's workers: each blocks
until the engine runs its side (`init_weight_update_group`, `update_weights_from_distributed`),
so the two run concurrently, e.g. the trainer in a Ray actor and the engine's call in the
driver (see docs/rl.md, "The call order").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from shoal.rl.buckets import named_tensors_of, pack, plan_buckets, tensor_meta
from shoal.rl.group import DEFAULT_TIMEOUT_S, WeightUpdateGroup
from shoal.rl_verbs import DEFAULT_BUCKET_BYTES

logger = logging.getLogger(__name__)

WeightSource = torch.nn.Module | dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightSender:
    """Broadcasts weights to every worker of one or more engines, bucket by bucket.

    `world_size`: 1 (this rank) + the engines' workers. `dtype`: the engine's weight dtype, to
    which tensors are cast before they go (None: as they are). `device`: where the buckets are
    packed (default: CUDA if available with the nccl backend, else the CPU)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if device is None:
            device = "cuda" if backend != "gloo" and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.group = WeightUpdateGroup(master_address, master_port, 0, world_size, self.device, backend, timeout_s)

    def _named(self, weights: WeightSource) -> list[tuple[str, torch.Tensor]]:
        named = named_tensors_of(weights)
        return named if self.dtype is None else [(n, t.to(self.dtype)) for n, t in named]

    def metadata(self, weights: WeightSource) -> dict[str, Any]:
        """The keyword arguments of the engine's `update_weights_from_distributed` for `weights`."""
        metas = [tensor_meta(name, tensor) for name, tensor in self._named(weights)]
        return {
            "names": [m.name for m in metas],
            "dtypes": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas],
            "bucket_bytes": self.bucket_bytes,
        }

    def send(self, weights: WeightSource) -> int:
        """Broadcast `weights` (a model's parameters, a dict or (name, tensor) pairs) in buckets;
        returns the number of buckets."""
        start = time.perf_counter()
        named = self._named(weights)
        by_name = dict(named)
        buckets = plan_buckets([tensor_meta(n, t) for n, t in named], self.bucket_bytes)
        for bucket in buckets:
            buffer = pack([by_name[m.name] for m in bucket], self.device)
            self.group.broadcast(buffer, src=0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("sent %d tensors in %d bucket(s) in %.2f s", len(named), len(buckets), time.perf_counter() - start)
        return len(buckets)

    def close(self) -> None:
        self.group.destroy()
