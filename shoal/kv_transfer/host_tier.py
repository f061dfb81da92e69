"""`HostKVTier`: a host-memory tier under the device prefix cache, as a `KVConnector`.

A cached block the block pool evicts (to give its slot to a new allocation) is not lost: it is
copied to a block of a host pool, under the same hash. A later request whose prefix continues
past the device cache's hit into blocks the host holds loads them back into its newly allocated
device blocks instead of recomputing them; the scheduler asks through the connector seam
(`num_loadable_tokens`, then `load_into`).

This side decides only: which hashes the host holds, which host block each is in, and an LRU
order for the host's own evictions. The copies themselves are instructions the next step
carries to the workers (`KVBlockCopies`, taken by `take_block_copies`), made before its forward:
offloads first (the evicted device block may be reallocated in this very step, even as a
load's target), then loads. A host block a load of the step reads is never an offload's target
in that step. Plain Python: the engine core imports this module.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.step import KVBlockCopies

if TYPE_CHECKING:
    from shoal.config import EngineConfig
    from shoal.engine_core.block_pool import BlockPool, KVCacheBlock
    from shoal.engine_core.request import Request
    from shoal.engine_core.scheduler import Scheduler
    from shoal.executors.abstract import Executor


@dataclass
class HostTierStats:
    """Cumulative: prompt tokens found on the host (after the device cache's hit), blocks copied
    back to the device, blocks copied to the host, and host blocks dropped to make room."""

    host_hit_tokens: int = 0
    blocks_loaded: int = 0
    blocks_offloaded: int = 0
    blocks_dropped: int = 0


class HostKVTier:
    def __init__(self, num_host_blocks: int, block_size: int, block_pool: BlockPool) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_host_blocks}")
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        # Hash → host block, least recently used first.
        self._blocks: OrderedDict[bytes, int] = OrderedDict()
        self._free_host_ids = list(range(num_host_blocks - 1, -1, -1))
        # Host blocks this step's loads read, or that a request was just told it may load:
        # never an offload's target until the step is built.
        self._pinned: set[int] = set()
        self._copies = _PendingCopies()
        self.stats = HostTierStats()
        block_pool.evict_listeners.append(self._offload)
        block_pool.reset_listeners.append(self.reset)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    # ---- the connector seam (the scheduler asks) ---------------------------------------------

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Full blocks after the device cache's hit that the host holds, in a row. Their host
        blocks are pinned until the step is built, so the allocation that follows (which may
        evict device blocks to the host) cannot drop them."""
        if num_computed_tokens % self.block_size:
            return 0
        first = num_computed_tokens // self.block_size
        max_blocks = (request.num_tokens - 1) // self.block_size  # as the device cache: one token left
        num_blocks = 0
        for block_hash in request.block_hashes[first:max_blocks]:
            host_id = self._blocks.get(block_hash)
            if host_id is None:
                break
            self._blocks.move_to_end(block_hash)
            self._pinned.add(host_id)
            num_blocks += 1
        return num_blocks * self.block_size

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        """Copy the host blocks of tokens [num_computed_tokens, + num_tokens) into the
        request's device blocks (a block only partly loaded is recomputed past the load)."""
        first = num_computed_tokens // self.block_size
        last = -(-(num_computed_tokens + num_tokens) // self.block_size)
        for index in range(first, last):
            host_id = self._blocks[request.block_hashes[index]]
            self._copies.load(host_id, block_ids[index])
        self.stats.host_hit_tokens += num_tokens
        self.stats.blocks_loaded += last - first

    def loads_in_background(self, request: Request) -> bool:
        """No: the copies are local and short, made before the step that reads them."""
        return False

    def cancel_load(self, request: Request, workers_alive: bool = True) -> None:
        """Nothing loads in the background here."""

    # ---- the block pool's evictions ----------------------------------------------------------

    def _offload(self, block: KVCacheBlock) -> None:
        """A cached device block is being evicted: keep it on the host (refreshing its place in
        the LRU order if the host already has it)."""
        block_hash = block.block_hash
        assert block_hash is not None
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        host_id = self._take_host_block()
        if host_id is None:
            return  # every host block is pinned by this step: the block is simply lost
        self._blocks[block_hash] = host_id
        self._copies.offload(block.block_id, host_id)
        self.stats.blocks_offloaded += 1

    def _take_host_block(self) -> int | None:
        """A free host block, else the least recently used one not pinned (its hash dropped)."""
        if self._free_host_ids:
            return self._free_host_ids.pop()
        for block_hash, host_id in self._blocks.items():
            if host_id not in self._pinned:
                del self._blocks[block_hash]
                self.stats.blocks_dropped += 1
                return host_id
        return None

    # ---- the step ----------------------------------------------------------------------------

    def take_block_copies(self) -> KVBlockCopies | None:
        """The copies the step just built must make before its forward; unpins the host."""
        self._pinned.clear()
        return self._copies.take()

    def reset(self) -> None:
        """Forget every hash (the weights changed: the host's KV is stale too). Copies already
        promised to a step still go, harmlessly."""
        for host_id in self._blocks.values():
            self._free_host_ids.append(host_id)
        self._blocks.clear()


class _PendingCopies:
    """The copies collected while one step is built."""

    def __init__(self) -> None:
        self.offload_block_ids: list[int] = []
        self.offload_host_ids: list[int] = []
        self.load_host_ids: list[int] = []
        self.load_block_ids: list[int] = []

    def offload(self, block_id: int, host_id: int) -> None:
        self.offload_block_ids.append(block_id)
        self.offload_host_ids.append(host_id)

    def load(self, host_id: int, block_id: int) -> None:
        self.load_host_ids.append(host_id)
        self.load_block_ids.append(block_id)

    def take(self) -> KVBlockCopies | None:
        if not self.offload_block_ids and not self.load_block_ids:
            return None
        copies = KVBlockCopies(self.offload_block_ids, self.offload_host_ids, self.load_host_ids, self.load_block_ids)
        self.__init__()  # type: ignore[misc]
        return copies


def start_host_tier(config: EngineConfig, executor: Executor, scheduler: Scheduler) -> HostKVTier | None:
    """With `kv_offload_bytes` (each worker allocated its host pool with its KV cache; the
    smallest count of blocks is everyone's), give the scheduler the tier as its KV connector."""
    kv_offload_bytes = config.cache_config.kv_offload_bytes
    if not kv_offload_bytes:
        return None
    num_host_blocks = min(executor.collective_rpc("num_host_kv_blocks"))
    if num_host_blocks < 1:
        raise ValueError(f"kv_offload_bytes={kv_offload_bytes} holds less than one KV block")
    tier = HostKVTier(num_host_blocks, config.cache_config.block_size, scheduler.kv_cache_manager.block_pool)
    scheduler.kv_connector = tier
    return tier


def host_tier_stats(tier: HostKVTier) -> dict[str, int]:
    """The tier's counters as `EngineCore.get_stats` reports them (and /metrics exposes)."""
    stats = tier.stats
    return {
        "kv_offload_num_host_blocks": tier.num_host_blocks,
        "kv_offload_cached_blocks": tier.num_cached_blocks,
        "kv_offload_host_hit_tokens": stats.host_hit_tokens,
        "kv_offload_blocks_loaded": stats.blocks_loaded,
        "kv_offload_blocks_offloaded": stats.blocks_offloaded,
        "kv_offload_blocks_dropped": stats.blocks_dropped,
    }
