"""The KV-cache events on the wire, in vLLM's format, so that routers written for vLLM
(Dynamo's, llm-d's) read shoal's as they are.

Each message is one engine step's events in a `KVEventBatch`, encoded as msgpack arrays
(`array_like`: fields by position), each event tagged with its class name:

- `BlockStored`: full blocks newly registered in the prefix cache, consecutive in one request
  (`block_hashes` in order, `parent_block_hash` the hash of the block before the first, None
  at the start of a prompt), with their `token_ids` (`block_size` per block).
- `BlockRemoved`: blocks whose hash left the prefix cache (evicted for reuse).
- `AllBlocksCleared`: the whole prefix cache was forgotten (a reset, a weight update).

Block hashes are the KV manager's own (`hash_block_tokens`: 16-byte blake2b digests over the
parent's hash and the block's token ids), so a router hashing a prompt with that function finds
the engine's blocks. `medium` says where the blocks live: "GPU" for the engine's own KV cache
(on a CPU engine too: it is the primary tier), "CPU" for a host tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

# The engine's own KV cache, whatever the device (vLLM's name for the primary tier).
MEDIUM_PRIMARY = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of the prefix cache; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_PRIMARY


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_PRIMARY


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """One engine step's events; `data_parallel_rank` is None for an engine of its own."""

    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def stored_events(
    block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int, indices: Sequence[int]
) -> list[BlockStored]:
    """`BlockStored` events for the blocks `indices` (ascending) of one request: one event per
    run of consecutive blocks, its parent the hash of the block before the run."""
    events = []
    start = 0
    for k in range(1, len(indices) + 1):
        if k == len(indices) or indices[k] != indices[k - 1] + 1:
            first, last = indices[start], indices[k - 1]
            events.append(
                BlockStored(
                    block_hashes=list(block_hashes[first : last + 1]),
                    parent_block_hash=block_hashes[first - 1] if first else None,
                    token_ids=list(token_ids[first * block_size : (last + 1) * block_size]),
                    block_size=block_size,
                )
            )
            start = k
    return events
