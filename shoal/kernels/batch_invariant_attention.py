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

`paged_attention_ref` is the CPU path (torch, float32 arithmetic, the step's tiles batched);
shoal/kernels/triton/batch_invariant.py has the CUDA kernel with the same tiling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.forward_context import AttentionMetadata
from shoal.kernels.dispatch import registered_kernel

Q_TILE = 16  # query positions per tile
KV_TILE = 64  # context positions per step of the online softmax (a multiple of Q_TILE)


def _num_kv_tiles(tile: int) -> int:
    """KV tiles that query tile `tile` walks: up to its last position, however full it is."""
    return -(-(tile + 1) * Q_TILE // KV_TILE)


@dataclass
class TilePlan:
    """The step's query tiles, built once per step from the host index arrays and kept in the
    metadata's `backend_state` for the other layers."""

    tile_request: torch.Tensor  # [num_tiles] the request of each tile
    tile_positions: torch.Tensor  # [num_tiles, Q_TILE] the positions of each tile's rows
    num_kv_tiles: np.ndarray  # [num_tiles] context tiles each walks
    token_rows: torch.Tensor  # [num_tokens] each query row's row among the tiles' (tile * Q_TILE + slot)


def plan_tiles(md: AttentionMetadata) -> TilePlan:
    starts, seq_lens = md.query_start_loc_cpu.numpy().astype(np.int64), md.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(starts)
    context_lens = seq_lens - query_lens
    first, last = context_lens // Q_TILE, (seq_lens - 1) // Q_TILE
    tiles_per_request = np.where(query_lens > 0, last - first + 1, 0)
    tile_request = np.repeat(np.arange(md.num_reqs), tiles_per_request)  # [num_tiles]
    tile_base = np.concatenate([[0], np.cumsum(tiles_per_request)[:-1]])  # each request's first tile
    tiles = first[tile_request] + np.arange(len(tile_request)) - tile_base[tile_request]  # absolute tile numbers
    token_request = np.repeat(np.arange(md.num_reqs), query_lens)  # [num_tokens]
    positions = context_lens[token_request] + np.arange(starts[-1]) - starts[token_request]
    token_rows = (tile_base[token_request] + positions // Q_TILE - first[token_request]) * Q_TILE + positions % Q_TILE
    device = md.block_tables.device
    return TilePlan(
        tile_request=torch.from_numpy(tile_request).to(device),
        tile_positions=torch.from_numpy(tiles[:, None] * Q_TILE + np.arange(Q_TILE)).to(device),
        num_kv_tiles=-(-(tiles + 1) * Q_TILE // KV_TILE),
        token_rows=torch.from_numpy(token_rows).to(device),
    )


def _step_plan(md: AttentionMetadata) -> TilePlan:
    if not isinstance(md.backend_state, TilePlan):
        md.backend_state = plan_tiles(md)
    return md.backend_state


def _context_tile(cache: torch.Tensor, md: AttentionMetadata, requests: torch.Tensor, first: int) -> torch.Tensor:
    """cache [num_blocks, block_size, nkv, hd] -> positions [first, first + KV_TILE) of each of
    `requests`, float32 [len(requests) * nkv, KV_TILE, hd], zeros past each context."""
    block_size = cache.shape[1]
    positions = first + torch.arange(KV_TILE, device=cache.device)  # [KV_TILE]
    valid = positions[None, :] < md.seq_lens[requests].long()[:, None]  # [R, KV_TILE]
    block_index = (positions // block_size).clamp(max=md.block_tables.shape[1] - 1)
    blocks = md.block_tables[requests][:, block_index].long()  # [R, KV_TILE]
    tokens = cache.flatten(0, 1)[blocks * block_size + positions % block_size].float()  # [R, KV_TILE, nkv, hd]
    tokens = tokens.masked_fill(~valid[:, :, None, None], 0.0)
    return tokens.transpose(1, 2).flatten(0, 1)  # [R * nkv, KV_TILE, hd]


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_size]; kv_cache [2, num_blocks, block_size, nkv,
    head_size] already holding this step's keys and values -> [num_tokens, num_heads, head_size].

    Every query tile of the step at once: torch's batched GEMM gives each batch entry the same
    bits whatever the number of entries (checked by the tests), so a tile's products do not
    depend on the tiles beside it. Tile by tile the context tiles are walked in order, each tile
    as many as it needs."""
    md = attn_metadata
    plan = _step_plan(md)
    num_tokens, num_heads, head_size = md.num_tokens, query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_tiles = len(plan.num_kv_tiles)
    rows = query.new_zeros(num_tiles * Q_TILE, num_heads, head_size, dtype=torch.float32)
    rows[plan.token_rows] = query[:num_tokens].float()
    # [num_tiles * nkv, group * Q_TILE, hd]: entry (tile, kv head), rows group-major then position
    q = rows.view(num_tiles, Q_TILE, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_tiles * num_kv_heads, group * Q_TILE, head_size)
    row_positions = plan.tile_positions.repeat(1, group)  # [num_tiles, group * Q_TILE]
    m = q.new_full(q.shape[:2], -float("inf"))
    denominator = q.new_zeros(q.shape[:2])
    acc = torch.zeros_like(q)
    heads = torch.arange(num_kv_heads, device=q.device)
    for kv_tile in range(int(plan.num_kv_tiles.max(initial=0))):
        active = torch.from_numpy(np.flatnonzero(plan.num_kv_tiles > kv_tile)).to(q.device)  # [A]
        entries = (active[:, None] * num_kv_heads + heads).flatten()  # [A * nkv]
        first = kv_tile * KV_TILE
        requests = plan.tile_request[active]
        k = _context_tile(kv_cache[0], md, requests, first)  # [A * nkv, KV_TILE, hd]
        v = _context_tile(kv_cache[1], md, requests, first)
        key_positions = first + torch.arange(KV_TILE, device=q.device)
        masked = key_positions[None, None, :] > row_positions[active][:, :, None]  # [A, rows, KV_TILE]
        scores = torch.bmm(q[entries], k.transpose(1, 2)) * scale  # [A * nkv, rows, KV_TILE]
        scores = scores.masked_fill(masked.repeat_interleave(num_kv_heads, dim=0), -float("inf"))
        m_old = m[entries]
        m_new = torch.maximum(m_old, scores.amax(dim=-1))
        alpha = torch.exp(m_old - m_new)  # rescales what earlier tiles accumulated
        p = torch.exp(scores - m_new[..., None])
        denominator[entries] = denominator[entries] * alpha + p.sum(dim=-1)
        acc[entries] = acc[entries] * alpha[..., None] + torch.bmm(p, v)
        m[entries] = m_new
    out = (acc / denominator[..., None]).view(num_tiles, num_kv_heads, group, Q_TILE, head_size)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_tiles * Q_TILE, num_heads, head_size)
    result = query.new_zeros(query.shape)  # rows no request owns (padding) stay zero
    result[:num_tokens] = out[plan.token_rows].to(query.dtype)
    return result


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
