"""Build the AttentionMetadata of a flat batch by hand, as the model runner would."""

from __future__ import annotations

import torch

from shoal.forward_context import AttentionMetadata


def allocate_block_tables(
    max_seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Give each request enough blocks for `max_seq_lens[i]` tokens, drawn in shuffled order so
    that no request's blocks are contiguous."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for seq_len in max_seq_lens:
        count = -(-seq_len // block_size)
        if used + count > num_blocks:
            raise ValueError("not enough KV blocks")
        tables.append(order[used : used + count])
        used += count
    return tables


def make_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Request i computes its positions [seq_lens[i] - query_lens[i], seq_lens[i]); the index
    tensors live on `device`, their host copies on the CPU."""
    slots = []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
        is_decode_only=all(q == 1 for q in query_lens),
    )


def make_paged_attention_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query [num_tokens, num_heads, head_size], kv_cache [2, num_blocks, block_size,
    num_kv_heads, head_size], metadata) with every request's whole context already cached in
    shuffled blocks, and spare blocks of noise that no request owns."""
    from shoal.kernels.reshape_and_cache import reshape_and_cache_ref

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    tables = allocate_block_tables(seq_lens, block_size, num_blocks, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    total = sum(seq_lens)
    keys = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    full = make_attention_metadata(seq_lens, seq_lens, tables, block_size)
    reshape_and_cache_ref(keys, values, kv_cache, full.slot_mapping)
    md = make_attention_metadata(query_lens, seq_lens, tables, block_size, device)
    query = torch.randn(md.num_tokens, num_heads, head_size, generator=gen).to(dtype)
    return query.to(device), kv_cache.to(device), md


def new_keys_and_values(kv_cache: torch.Tensor, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values, [num_tokens, num_kv_heads, head_size] each, read back from
    the cache at the batch's slots (what an attention layer holds beside the cache it wrote)."""
    slots = md.slot_mapping.long()
    return kv_cache[0].flatten(0, 1)[slots], kv_cache[1].flatten(0, 1)[slots]
