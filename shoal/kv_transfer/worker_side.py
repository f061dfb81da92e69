"""`KVTransferWorker`: a worker's side of prefill/decode disaggregation — its transport, its KV
layout, its loads in the background, and what the engine core calls through `collective_rpc`
(`Worker.save_kv`; `Worker.start_kv_load`, `ended_kv_loads`, `cancel_kv_loads`). Each
tensor-parallel rank moves its own shard, under the transfer id with its rank appended."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shoal.kv_transfer.background_loads import BackgroundLoads
from shoal.kv_transfer.transport import KVTransport, kv_layout, load_blocks, make_transport, save_blocks

if TYPE_CHECKING:
    from shoal.kv_transfer.background_loads import CopyGate
    from shoal.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class KVTransferWorker:
    def __init__(self, runner: ModelRunner, rank: int, transport: KVTransport | None = None) -> None:
        self.runner = runner
        self.rank = rank
        self.transport = transport or make_transport(runner.device)
        specs = [layer.kv_cache_spec for layer in runner.model.attention_layers()]  # type: ignore[union-attr, operator]
        self.layout = kv_layout(specs, runner.block_size, runner.dtype)
        self.loads = BackgroundLoads(self.load, runner.device)

    def _rank_id(self, transfer_id: str) -> str:
        return f"{transfer_id}-r{self.rank}"

    def save(self, transfer_id: str, block_ids: list[int]) -> float:
        """Publish the blocks `block_ids`; returns the seconds it took."""
        start = time.perf_counter()
        save_blocks(self.transport, self._rank_id(transfer_id), self.layout, self.runner.kv_caches, block_ids)
        return time.perf_counter() - start

    def load(
        self, transfer_id: str, first_block: int, block_ids: list[int], timeout_s: float, gate: CopyGate | None = None
    ) -> None:
        """Copy the transfer's blocks from `first_block` on into `block_ids`, through `gate`
        (raises `KVTransferError`). Runs on a load's own thread (`self.loads`)."""
        kv_caches = self.runner.kv_caches
        load_blocks(
            self.transport, self._rank_id(transfer_id), self.layout, kv_caches, first_block, block_ids, timeout_s, gate
        )

    def close(self) -> None:
        self.transport.close()
