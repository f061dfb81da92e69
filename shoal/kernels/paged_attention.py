"""Causal attention of a flat batch of prefill and decode tokens over a paged KV cache (Kwon et
al., 2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"),
with grouped-query attention (Ainslie et al., 2023, "GQA").

Request i's new tokens are rows `query_start_loc[i]:query_start_loc[i+1]` of `query`; its context
is the first `seq_lens[i]` positions of its blocks, already holding this step's keys and values
(`reshape_and_cache` runs first). New token j of request i sits at position
`seq_lens[i] - query_len_i + j` and attends to every position up to and including its own.

The reference is the CPU path of the engine, so it is written for speed as well as clarity:
decode requests (one new token each) run as one padded, masked SDPA call; prefill chunks run one
SDPA call per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.forward_context import AttentionMetadata
from shoal.kernels import fresh_prefill_attention as fresh
from shoal.kernels.dispatch import csrc_op, registered_kernel
from shoal.kernels.fresh_prefill_attention import FreshPrefillPlan


@dataclass
class PagedAttentionPlan:
    """The batch split into decode requests (batched) and prefill requests (looped), computed
    once per step (`step_plan`) and shared by its layers through `AttentionMetadata.backend_state`."""

    decode_rows: torch.Tensor  # [num_decodes] int64, the query row of each decode request
    # int32, as the metadata holds them: a compiled decode kernel (MLA's) reads them as a decode
    # step passes them, so a mixed step launches no variant of its own.
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks] int32
    prefills: list[tuple[int, int, int]]  # (start_row, end_row, seq_len) of each other request
    prefill_block_tables: torch.Tensor  # [num_prefills, max_num_blocks_per_req] int64


def plan_paged_attention(md: AttentionMetadata, block_size: int) -> PagedAttentionPlan:
    """Split the batch by query length, reading the host copies of the index arrays (no device sync)."""
    starts = md.query_start_loc_cpu.tolist()
    seq_lens = md.seq_lens_cpu.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in range(md.num_reqs)]
    decodes = [i for i in range(md.num_reqs) if query_lens[i] == 1]
    others = [i for i in range(md.num_reqs) if query_lens[i] > 1]
    device = md.block_tables.device
    max_decode_len = max((seq_lens[i] for i in decodes), default=0)
    max_decode_blocks = -(-max_decode_len // block_size)
    decode_index = torch.tensor(decodes, dtype=torch.int64, device=device)
    return PagedAttentionPlan(
        decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.int64, device=device),
        decode_seq_lens=torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int32, device=device),
        decode_block_tables=md.block_tables[decode_index, :max_decode_blocks].to(torch.int32),
        prefills=[(starts[i], starts[i + 1], seq_lens[i]) for i in others],
        prefill_block_tables=md.block_tables[torch.tensor(others, dtype=torch.int64, device=device)].to(torch.int64),
    )


def step_plan(md: AttentionMetadata, block_size: int) -> PagedAttentionPlan:
    """The step's plan: built by the first layer that asks, kept in `backend_state` for the others
    (the metadata is made anew each step)."""
    if not isinstance(md.backend_state, PagedAttentionPlan):
        md.backend_state = plan_paged_attention(md, block_size)
    return md.backend_state


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, nkv, hd], block_table [..., nb] -> [..., nkv, nb * block_size, hd]."""
    blocks = cache[block_table]  # [..., nb, block_size, nkv, hd]
    tokens = blocks.flatten(-4, -3)  # [..., nb * block_size, nkv, hd]
    return tokens.transpose(-3, -2)  # [..., nkv, nb * block_size, hd]


def _decode(
    out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: PagedAttentionPlan, scale: float
) -> None:
    """All one-token requests at once, padded to the longest context and masked past each end."""
    rows = plan.decode_rows
    key = _gather(kv_cache[0], plan.decode_block_tables).to(query.dtype)  # [R, nkv, L, hd]
    value = _gather(kv_cache[1], plan.decode_block_tables).to(query.dtype)  # [R, nkv, L, hd]
    positions = torch.arange(key.shape[-2], device=query.device)
    mask = (positions < plan.decode_seq_lens[:, None])[:, None, None, :]  # [R, 1, 1, L]
    q = query[rows].unsqueeze(2)  # [R, nh, 1, hd]
    attn = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    out[rows] = attn.squeeze(2)  # [R, nh, hd]


def _prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    end: int,
    seq_len: int,
    scale: float,
) -> None:
    """One request's chunk of `end - start` new tokens after `seq_len - (end - start)` cached ones."""
    query_len = end - start
    num_blocks = -(-seq_len // kv_cache.shape[2])
    key = _gather(kv_cache[0], block_table[:num_blocks])[:, :seq_len].to(query.dtype)  # [nkv, S, hd]
    value = _gather(kv_cache[1], block_table[:num_blocks])[:, :seq_len].to(query.dtype)  # [nkv, S, hd]
    q = query[start:end].transpose(0, 1)  # [nh, query_len, hd]
    context_len = seq_len - query_len
    mask = None
    if context_len > 0:  # SDPA's is_causal aligns the diagonal top-left; ours is offset
        positions = torch.arange(seq_len, device=query.device)
        mask = positions[None, :] <= (context_len + positions[:query_len])[:, None]  # [query_len, S]
    q, key, value = q.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)  # a batch of one: [1, heads, len, hd]
    attn = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # [1, nh, query_len, hd]
    out[start:end] = attn[0].transpose(0, 1)  # [query_len, nh, hd]


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_size]; kv_cache [2, num_blocks, block_size, nkv, head_size]."""
    plan = step_plan(attn_metadata, kv_cache.shape[2])
    out = query.new_zeros(query.shape)  # contiguous; rows no request owns (padding) stay zero
    if plan.decode_rows.numel() > 0:
        _decode(out, query, kv_cache, plan, scale)
    for i, (start, end, seq_len) in enumerate(plan.prefills):
        _prefill(out, query, kv_cache, plan.prefill_block_tables[i], start, end, seq_len, scale)
    return out


# The one switch between the attention kernels on CUDA, set from benchmarks/bench_kernels.py:
# a pure-decode batch (one new token per request) runs the csrc split-K kernel ("csrc") or the
# Triton decode kernel ("triton"). A batch with prefill tokens always prefers Triton, whose
# kernel reads each KV tile once per tile of query tokens; the csrc kernel handles such batches
# correctly but re-reads the context for every query token.
DECODE_KERNEL = "triton"
# Head sizes the csrc kernel is compiled for.
CSRC_HEAD_SIZES = (64, 128, 256)
# Dtypes whose fresh prompts may run as flash attention on the step's keys and values
# (`fresh_prefill_attention.BY_SDPA`); float32 keeps every path reading the cache.
FRESH_PREFILL_DTYPES = (torch.float16, torch.bfloat16)


def _attention_kernel(query: torch.Tensor, md: AttentionMetadata) -> Callable[..., object] | None:
    """The compiled kernel for this batch, or None to run the reference."""
    csrc = csrc_op("paged_attention", query) if query.shape[-1] in CSRC_HEAD_SIZES else None
    if md.max_query_len == 1 and DECODE_KERNEL == "csrc" and csrc is not None:
        return csrc
    return registered_kernel("paged_attention", query) or csrc


def _fresh_prefill_plan(
    query: torch.Tensor,
    md: AttentionMetadata,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> FreshPrefillPlan | None:
    """The batch's plan when fresh prompts go to SDPA and the (Triton) kernel runs a batch with
    prefill tokens in half precision with this step's keys at hand; else None."""
    if not fresh.BY_SDPA or key is None or value is None:
        return None
    if md.max_query_len == 1 or query.dtype not in FRESH_PREFILL_DTYPES:
        return None
    if md.fresh_prefill_plan is not None:
        return md.fresh_prefill_plan
    return fresh.plan_fresh_prefills(md.query_start_loc_cpu.numpy(), md.seq_lens_cpu.numpy())


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compiled schema: `paged_attention(out, query, kv_cache, query_start_loc, seq_lens,
    block_tables, max_query_len, max_seq_len, scale, num_splits=0) -> ()`, writing `out` like
    `query` (num_splits: parts each context is split into; 0 lets the kernel choose).

    key, value [num_tokens, num_kv_heads, head_size]: this step's keys and values, already in
    the cache. Given them, the Triton kernel runs fresh prompts (no cached prefix) on them with
    dense flash attention; every other path reads the cache alone and ignores them."""
    op = _attention_kernel(query, attn_metadata)
    if op is None:
        return paged_attention_ref(query, kv_cache, attn_metadata, scale)
    md = attn_metadata
    out = query.new_empty(query.shape)
    args = (out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len, md.max_seq_len)
    # Beyond the csrc op's schema: what only the Triton kernel takes.
    extra: dict[str, object] = {}
    if op is registered_kernel("paged_attention", query):
        plan = _fresh_prefill_plan(query, md, key, value)
        if plan is not None:
            extra.update(key=key, value=value, fresh_prefill_plan=plan)
        if md.decode_order is not None:
            extra["decode_order"] = md.decode_order
    op(*args, scale, **extra)
    if out.shape[0] > md.num_tokens:  # rows past the batch (padding) are zero, as in the reference
        out[md.num_tokens :].zero_()
    return out
