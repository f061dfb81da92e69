"""Paged causal attention whose result for a query token depends only on that token's query and
its context, not on the batch around it: the attention of `batch_invariant=True`.

The default kernels split the work by the batch: decode tokens apart from prefill chunks, query
tiles counted from the start of each chunk, a context split across as many programs as fill the
GPU. A token's output then changes with how its prompt was chunked, what else ran beside it and
whether its prefix came from the cache. Here every split is fixed in absolute positions:

- query tiles cover positions [t * Q_TILE, (t + 1) * Q_TILE) of a request, so a token always
  sits in the same row of the same tile shape (rows of the tile outside this step's chunk are
  zeros, computed and dropped);
- tile t walks the context in KV_TILE-position tiles from position 0, always
  ceil((t + 1) * Q_TILE / KV_TILE) of them, with flash attention's online softmax (Dao et al.,
  2022) in that order. Positions after a row's own are masked to -inf, so they add exactly zero
  (their exp is 0 and the running maximum does not move), whether they hold keys of later
  tokens of the chunk or the zeros past the context.

`paged_attention_ref` is the CPU path (torch, float32 arithmetic, one tile at a time);
shoal/kernels/triton/batch_invariant.py has the CUDA kernel with the same tiling.
"""

from __future__ import annotations

import torch

from shoal.forward_context import AttentionMetadata
from shoal.kernels.dispatch import registered_kernel

Q_TILE = 16  # query positions per tile
KV_TILE = 64  # context positions per step of the online softmax (a multiple of Q_TILE)


def _num_kv_tiles(tile: int) -> int:
    """KV tiles that query tile `tile` walks: up to its last position, however full it is."""
    return -(-(tile + 1) * Q_TILE // KV_TILE)


def _context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, num_positions: int) -> torch.Tensor:
    """cache [num_blocks, block_size, nkv, hd] -> the request's first `num_positions` positions as
    float32 [nkv, num_positions, hd], zeros past seq_len."""
    block_size = cache.shape[1]
    num_blocks = -(-min(seq_len, num_positions) // block_size)
    tokens = cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]  # [seq_len, nkv, hd]
    context = tokens.new_zeros(num_positions, *tokens.shape[1:], dtype=torch.float32)
    context[: tokens.shape[0]] = tokens[:num_positions]
    return context.transpose(0, 1)  # [nkv, num_positions, hd]


def _attend_tile(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile: int, scale: float
) -> torch.Tensor:
    """q [nkv, group * Q_TILE, hd] (rows group-major, then position) of query tile `tile` over
    its context tiles -> [nkv, group * Q_TILE, hd]."""
    num_rows = q.shape[1]
    positions = tile * Q_TILE + torch.arange(Q_TILE, device=q.device).repeat(num_rows // Q_TILE)  # [group * Q_TILE]
    m = q.new_full((q.shape[0], num_rows), -float("inf"))
    denominator = q.new_zeros(q.shape[0], num_rows)
    acc = torch.zeros_like(q)
    for kv_tile in range(_num_kv_tiles(tile)):
        first = kv_tile * KV_TILE
        k = keys[:, first : first + KV_TILE]  # [nkv, KV_TILE, hd]
        v = values[:, first : first + KV_TILE]
        key_positions = first + torch.arange(KV_TILE, device=q.device)
        scores = torch.bmm(q, k.transpose(1, 2)) * scale  # [nkv, rows, KV_TILE]
        scores = scores.masked_fill((key_positions[None, :] > positions[:, None])[None], -float("inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        alpha = torch.exp(m - m_new)  # rescales what earlier tiles accumulated
        p = torch.exp(scores - m_new[..., None])
        denominator = denominator * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.bmm(p, v)
        m = m_new
    return acc / denominator[..., None]


def _request(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    end: int,
    seq_len: int,
    scale: float,
) -> None:
    """Rows start:end of query (positions seq_len - (end - start) ... seq_len - 1), tile by tile."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    context_len = seq_len - (end - start)
    first_tile, last_tile = context_len // Q_TILE, (seq_len - 1) // Q_TILE
    num_positions = _num_kv_tiles(last_tile) * KV_TILE
    keys = _context(kv_cache[0], block_table, seq_len, num_positions)  # [nkv, P, hd]
    values = _context(kv_cache[1], block_table, seq_len, num_positions)
    # The chunk's rows at their positions in whole tiles, zeros around them.
    offset = context_len - first_tile * Q_TILE
    num_tiles = last_tile - first_tile + 1
    rows = query.new_zeros(num_tiles * Q_TILE, num_heads, head_size, dtype=torch.float32)
    rows[offset : offset + end - start] = query[start:end]
    tiles = rows.view(num_tiles, Q_TILE, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    results = []
    for j in range(num_tiles):
        q = tiles[j].reshape(num_kv_heads, group * Q_TILE, head_size)  # [nkv, group * Q_TILE, hd]
        results.append(_attend_tile(q, keys, values, first_tile + j, scale))
    attended = torch.stack(results).view(num_tiles, num_kv_heads, group, Q_TILE, head_size)
    attended = attended.permute(0, 3, 1, 2, 4).reshape(num_tiles * Q_TILE, num_heads, head_size)
    out[start:end] = attended[offset : offset + end - start].to(out.dtype)


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_size]; kv_cache [2, num_blocks, block_size, nkv,
    head_size] already holding this step's keys and values -> [num_tokens, num_heads, head_size]."""
    md = attn_metadata
    starts, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    out = query.new_zeros(query.shape)  # rows no request owns (padding) stay zero
    for i in range(md.num_reqs):
        if starts[i + 1] > starts[i]:
            _request(out, query, kv_cache, md.block_tables[i], starts[i], starts[i + 1], seq_lens[i], scale)
    return out


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The Triton kernel "bi_paged_attention" on CUDA, `paged_attention_ref` elsewhere."""
    kernel = registered_kernel("bi_paged_attention", query)
    if kernel is None:
        return paged_attention_ref(query, kv_cache, attn_metadata, scale)
    md = attn_metadata
    out = torch.zeros_like(query)
    kernel(out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len, scale)
    return out
