"""Cases shared by the CPU test of the batch-invariant ops and their Triton check under the
interpreter: one request's attention outputs under different schedules (whole, chunked beside
other requests, one token a step), which must agree bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.kernels.metadata_utils import allocate_block_tables, make_attention_metadata

AttentionFn = Callable[..., torch.Tensor]  # (query, kv_cache, metadata, scale) -> out

SEQ_LEN = 70  # the target request's context: more than one KV tile and many query tiles
# Chunkings of the target's positions [0, SEQ_LEN): as one step; chunked with other requests
# around; a cached prefix then one token a step (decode).
SCHEDULES = {
    "whole": [(0, SEQ_LEN)],
    "chunked": [(0, 5), (5, 21), (21, 22), (22, 50), (50, 70)],
    "decode": [(0, 61)] + [(p, p + 1) for p in range(61, 70)],
}


class AttentionCase:
    """A paged cache holding the target request's SEQ_LEN keys and values and three neighbours',
    and a query vector for every target position."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype, device):
        gen = torch.Generator().manual_seed(0)
        self.block_size, self.device = block_size, device
        self.neighbour_lens = [9, 40, 3]
        lens = [SEQ_LEN, *self.neighbour_lens]
        num_blocks = sum(-(-s // block_size) for s in lens) + 2
        self.tables = allocate_block_tables(lens, block_size, num_blocks, gen)
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
        self.kv_cache = self.kv_cache.to(device)
        self.queries = torch.randn(SEQ_LEN, num_heads, head_size, generator=gen).to(dtype).to(device)
        self.neighbour_queries = [
            torch.randn(n, num_heads, head_size, generator=gen).to(dtype).to(device) for n in self.neighbour_lens
        ]
        self.scale = head_size**-0.5

    def run(self, attention: AttentionFn, schedule: list[tuple[int, int]]) -> torch.Tensor:
        """The target's output at every position, each chunk run in a batch of its own: the
        neighbours (their last 1 to all tokens) before and after it, varying by chunk."""
        rows = []
        for i, (start, end) in enumerate(schedule):
            first = i % 3  # which neighbours go before the target
            query_lens = [min(n, 1 + (i * 7) % n) for n in self.neighbour_lens]
            parts = [(q[-ql:], ql, n, t) for q, ql, n, t in zip(
                self.neighbour_queries, query_lens, self.neighbour_lens, self.tables[1:]
            )]  # fmt: skip
            batch = [*parts[:first], (self.queries[start:end], end - start, end, self.tables[0]), *parts[first:]]
            query = torch.cat([b[0] for b in batch])
            md = make_attention_metadata(
                [b[1] for b in batch], [b[2] for b in batch], [b[3] for b in batch], self.block_size, self.device
            )
            out = attention(query, self.kv_cache, md, self.scale)
            offset = sum(b[1] for b in batch[:first])
            rows.append(out[offset : offset + end - start])
        return torch.cat(rows)


def check_schedules_agree(attention: AttentionFn, case: AttentionCase) -> list[str]:
    """The schedules whose outputs differ from the whole-prompt run in any bit."""
    whole = case.run(attention, SCHEDULES["whole"])
    return [name for name, s in SCHEDULES.items() if not torch.equal(case.run(attention, s), whole)]
