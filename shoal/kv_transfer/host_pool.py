"""`HostKVPool`: the worker's side of the host-memory tier — host blocks beside the KV cache,
and the copies a step asks for (`KVBlockCopies`, decided by shoal/kv_transfer/host_tier.py).

Each layer's host pool is laid out block first, `[num_host_blocks, num_parts, block_size,
num_kv_heads, head_size]`, so that one block is one contiguous run of host memory (one copy per
block and layer). On GPU the pool is pinned and the copies run on a side stream: it waits for
what the compute stream has queued (the KV that earlier steps wrote), and the compute stream
waits for it before the step's forward; the copies thus overlap the host's work on the step
(inputs, metadata) and any step still running. On CPU the same code copies synchronously.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from shoal.step import KVBlockCopies

logger = logging.getLogger(__name__)


class HostKVPool:
    def __init__(self, kv_caches: Callable[[], list[torch.Tensor]], num_host_blocks: int) -> None:
        """`kv_caches` gives the device caches of the moment (a restarted worker allocates new
        ones; the engine core then forgets what the host held)."""
        self.kv_caches = kv_caches
        device = kv_caches()[0].device
        pin = device.type == "cuda"
        # [num_host_blocks, num_parts, block_size, num_kv_heads, head_size] per layer
        self.host_caches = [
            torch.empty((num_host_blocks, cache.shape[0], *cache.shape[2:]), dtype=cache.dtype, pin_memory=pin)
            for cache in kv_caches()
        ]
        self.stream = torch.cuda.Stream(device) if pin else None
        logger.info(
            "host KV tier: %d blocks, %.2f GiB%s",
            num_host_blocks,
            sum(c.numel() * c.element_size() for c in self.host_caches) / 2**30,
            " pinned" if pin else "",
        )

    @classmethod
    def for_budget(cls, kv_caches: Callable[[], list[torch.Tensor]], kv_offload_bytes: int) -> HostKVPool | None:
        """As many host blocks as `kv_offload_bytes` holds (a block: every layer's share); None
        when not one fits."""
        block_bytes = sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches())
        num_blocks = kv_offload_bytes // block_bytes
        return cls(kv_caches, num_blocks) if num_blocks > 0 else None

    @property
    def num_blocks(self) -> int:
        return self.host_caches[0].shape[0] if self.host_caches else 0

    def apply(self, copies: KVBlockCopies) -> None:
        """The step's offloads, then its loads, ordered before the step's forward."""
        if self.stream is None:
            self._copy(copies)
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(copies)
        compute.wait_stream(self.stream)

    @torch.inference_mode()
    def _copy(self, copies: KVBlockCopies) -> None:
        non_blocking = self.stream is not None
        for cache, host in zip(self.kv_caches(), self.host_caches, strict=True):
            for block_id, host_id in zip(copies.offload_block_ids, copies.offload_host_ids, strict=True):
                host[host_id].copy_(cache[:, block_id], non_blocking=non_blocking)
            for host_id, block_id in zip(copies.load_host_ids, copies.load_block_ids, strict=True):
                cache[:, block_id].copy_(host[host_id], non_blocking=non_blocking)

    def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(RuntimeError):
                self.stream.synchronize()
        self.host_caches = []
