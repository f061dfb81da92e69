"""`KVCacheManager`: which blocks each request holds, and prefix-cache lookups over them.

Prefix caching works on full blocks. Block i of a request is identified by a hash that covers
block i-1's hash and block i's token ids, so equal hashes mean equal whole prefixes. A request
arriving with a prompt whose first k blocks are cached starts with `k * block_size` computed
tokens and shares those blocks (reference counts) instead of recomputing them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.engine_core.block_pool import BlockPool, KVCacheBlock
from shoal.engine_core.request import Request
from shoal.kv_events.events import stored_events

_ROOT_HASH = b"shoal-kv-root"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block: its parent's hash and its own token ids.

    A cryptographic hash (not Python's `hash`) so that no client can craft two prompts whose
    blocks collide and read each other's cache.
    """
    digest = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def adapter_root_hash(lora_name: str | None) -> bytes | None:
    """The parent of a request's first block: the adapter's (None: the base model's root), so
    that no block is ever shared between two adapters or an adapter and the base model (the
    same tokens have other keys and values under another adapter)."""
    if lora_name is None:
        return None
    return hashlib.blake2b(b"shoal-kv-lora:" + lora_name.encode(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of each request's blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count.

        At least one token is always left to compute: the model must run on the last prompt
        token to produce the next token's logits.
        """
        if not self._uses_prefix_cache(request):
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        cache_up_to: int | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of the request, after taking the prefix
        hit `new_computed_blocks`; returns the newly allocated blocks, or None if they do not
        fit (then nothing changed). Blocks full once the tokens are computed join the prefix
        cache; with `cache_up_to`, only those within its first `cache_up_to` tokens (KV still to
        be loaded into the others: a later allocation registers them)."""
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_tokens_to_cache = num_tokens_after if cache_up_to is None else cache_up_to
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and not new_computed_blocks and num_tokens_after <= len(blocks) * self.block_size:
            # Most decode steps: the new token fits in the last block.
            if self.enable_caching:
                self._cache_full_blocks(request, blocks, num_tokens_to_cache)
            return []
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        is_admission = not blocks
        num_new_blocks = -(-num_tokens_after // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cached blocks that are free now stop being free once this request takes them.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if is_admission:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if is_admission and self._uses_prefix_cache(request):
            # Counted once the request gets in, not on every lookup while it waits for blocks.
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_new_computed_tokens
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens_to_cache)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks; the last blocks are evicted first, since a shared
        prefix lives in the first ones."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
        for request_id, blocks in self.req_to_blocks.items():
            # Blocks still held (even partial ones) hold stale KV: never register them again.
            self.num_cached_blocks[request_id] = len(blocks)

    def _uses_prefix_cache(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, and routed experts the
        # router's choice at every position, so nothing may be skipped.
        params = request.sampling_params
        return self.enable_caching and params.prompt_logprobs is None and not params.return_routed_experts

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that are full once `num_tokens` tokens are computed."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        stored = [i for i in range(start, num_full) if self.block_pool.cache_block(blocks[i], request.block_hashes[i])]
        if self.block_pool.kv_events is not None and stored:
            self.block_pool.kv_events += stored_events(
                request.block_hashes, request.all_token_ids, self.block_size, stored
            )
        self.num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's block hashes over every full block of its known tokens."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else adapter_root_hash(request.lora_name)
            hashes.append(hash_block_tokens(parent, tokens[i * self.block_size : (i + 1) * self.block_size]))
