"""`BlockPool`: the paged KV cache's blocks, their reference counts, and the prefix cache.

A block is free when no request holds it (`ref_cnt == 0`). Free blocks wait in an LRU queue;
a free block may still carry a hash, so a later request with the same prefix can take it back
(a prefix-cache hit). A new allocation takes the least recently freed block and evicts its
hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from shoal.kv_events.events import AllBlocksCleared, BlockRemoved, KVEvent


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full, hashed block of tokens that others may reuse.
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the next to be reused.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}
        # KV-cache events since the engine last took them (a list only while they are
        # published: see shoal/kv_events/); None costs one test per eviction.
        self.kv_events: list[KVEvent] | None = None
        # Told of each cached block as it is evicted (its hash still set) and of a reset of the
        # whole cache: the host-memory tier (shoal/kv_transfer/host_tier.py) listens.
        self.evict_listeners: list[Callable[[KVCacheBlock], None]] = []
        self.reset_listeners: list[Callable[[], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (least recently freed first), evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order: freed first, evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full block under its hash; False if it was not. An equal block cached
        earlier stays the one that future requests find; this one is then simply not shared."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def take_kv_events(self) -> list[KVEvent]:
        """The events collected since the last call (none unless collecting)."""
        events, self.kv_events = self.kv_events, ([] if self.kv_events is not None else None)
        return events or []

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a weight update, cached KV is stale)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        for listener in self.reset_listeners:
            listener()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            for listener in self.evict_listeners:
                listener(block)
            del self._cached[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.append(BlockRemoved(block_hashes=[block.block_hash]))
            block.block_hash = None
