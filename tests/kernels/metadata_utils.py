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
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Request i computes its positions [seq_lens[i] - query_lens[i], seq_lens[i])."""
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
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_tables=torch.tensor(padded, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
        is_decode_only=all(q == 1 for q in query_lens),
    )
