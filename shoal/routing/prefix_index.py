"""`PrefixIndex`: which prefix-cache blocks each replica holds, kept from its KV-cache events,
and how much of a prompt each could take from its cache.

A prompt is hashed block by block with the KV manager's own function (`hash_block_tokens`,
each hash covering the whole prefix before it), so a hash in a replica's set means the replica
holds that whole prefix. Like the engine's own lookup, a match counts full blocks from the start
of the prompt until the first one missing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from shoal.engine_core.kv_cache_manager import adapter_root_hash, hash_block_tokens
from shoal.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> list[bytes]:
    """The hashes of the prompt's full blocks, as the engine's KV manager computes them (a LoRA
    adapter's blocks descend from the adapter's own root)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else adapter_root_hash(lora_name)
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
    return hashes


class PrefixIndex:
    """Block hashes per replica; events arrive on subscriber threads, lookups on the router's."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[bytes]] = {}
        self._lock = threading.Lock()

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        with self._lock:
            blocks = self._blocks.setdefault(replica, set())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    blocks.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def clear(self, replica: str) -> None:
        """Forget a replica's blocks (events lost, or its engine restarted)."""
        with self._lock:
            self._blocks.pop(replica, None)

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return len(self._blocks.get(replica, ()))

    def matched_blocks(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many of the prompt's first blocks the replica holds."""
        with self._lock:
            blocks = self._blocks.get(replica, set())
            for i, block_hash in enumerate(hashes):
                if block_hash not in blocks:
                    return i
            return len(hashes)
