"""Triton attention over the paged KV cache for a flat batch of prefill and decode tokens (Kwon
et al., 2023, "PagedAttention"), with grouped-query attention, flash attention's online softmax
(Dao et al., 2022) and split-K decoding ("Flash-Decoding", Dao et al., 2023). Semantics:
`paged_attention_ref` in shoal/kernels/paged_attention.py; `triton_paged_attention` takes the
arguments of the compiled op `paged_attention`.

Two kernels:

- `_unified_attention_kernel` runs the whole batch in one launch. A program takes BLOCK_Q query
  tokens of one request and the HEADS_PER_KV query heads of one KV head, so its BLOCK_M rows
  (token-major: row r is token r // HEADS_PER_KV, head r % HEADS_PER_KV) share every key and
  value tile it loads. It walks the request's context in BLOCK_N-position tiles up to the
  causal bound of its last token, gathering each tile's cache rows through the block table.
  Prefix-cache hits need nothing special: the request's context_len = seq_len - query_len
  cached positions simply come first.
- `_decode_kernel` + `_decode_reduce_kernel` serve the requests with one new token: a program
  takes one request and one KV head, and the context is split across NUM_SPLITS programs when
  the batch alone cannot fill the GPU; the second kernel merges the partial softmaxes. A
  decode-only batch runs these alone; a mixed batch runs them for its one-token requests and
  the unified kernel for the rest (`SPLIT_MIXED_BATCHES`). The GPU starts programs in the order
  of their index, so the caller may pass the requests longest context first (`decode_order`):
  the long programs then start in the first waves and the short ones fill the last, instead of
  a long one started last running on while the other SMs sit idle (longest-processing-time-first
  list scheduling). Numbering the programs KV head first (`DecodeTuning.heads_fastest`) puts the
  programs reading one cache block's interleaved KV heads side by side. Both apply to unsplit
  grids only, the ones that run in waves.

With SHOAL_FRESH_PREFILL_ATTENTION=flash or sdpa (`fresh_prefill_attention.BY_SDPA`; off by default),
fresh prompts (no cached prefix: seq_len == query_len) leave both kernels when the caller passes
this step's keys and values and the batch's `FreshPrefillPlan`: they run as PyTorch's SDPA on
those keys and values (shoal/kernels/fresh_prefill_attention.py), the unified kernel skips them
(SKIP_FRESH) and is not launched at all when no prefill chunk after a cached prefix is left.

Numbering the unified kernel's programs: the query tiles of all requests share one grid axis
with no host-side list. Request i's tiles are numbered from query_start_loc[i] // BLOCK_Q + i,
which leaves room for its ceil(query_len_i / BLOCK_Q) tiles (floor((a + q) / B) - floor(a / B)
+ 1 >= ceil(q / B)); so num_tokens // BLOCK_Q + num_reqs programs cover the batch, each finds
its request by binary search, and those numbered past their request's last tile exit at once.

Softmax runs in base 2: scores are scaled by scale * log2(e) so that exp2 replaces exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels import fresh_prefill_attention as fresh
from shoal.kernels.fresh_prefill_attention import FreshPrefillPlan
from shoal.kernels.triton import num_sms
from shoal.kernels.triton.precision import dot_precision

LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in its partial write than it saves
# The reduce kernel is compiled per SPLITS_PAD; padding every split count up to 16 (all that a
# 4,096-token context can have) to one variant keeps a mixed batch with, say, 3 splits from
# compiling a new one in the middle of serving.
_MIN_SPLITS_PAD = 16


def _reduce_width(num_splits: int) -> int:
    return max(_MIN_SPLITS_PAD, triton.next_power_of_2(num_splits))


@dataclass
class DecodeTuning:
    """Launch parameters of the decode kernel (benchmarks/sweep_attention.py sweeps them)."""

    block_n: int = 128  # context positions per tile (at most 32 when the head size pads past 128)
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 16  # split contexts until the grid has this many programs per SM,
    # but only grids with fewer than this many programs per SM: a grid that already fills the GPU
    # gains less from splitting than the partial writes and the reduce kernel cost (sweep: batch
    # 256 runs 3.5% faster unsplit, batch 64 4% faster split).
    split_below_per_sm: int = 4
    # Number the programs KV head first, so that the programs reading one cache block's KV heads
    # (interleaved rows of one contiguous block) run side by side.
    heads_fastest: bool = True
    longest_first: bool = True  # take the requests in the caller's decode_order, if it passes one


DECODE_TUNING = DecodeTuning()


@dataclass
class UnifiedTuning:
    """Launch parameters of the unified (prefill and mixed) kernel, swept like DecodeTuning."""

    block_m: int = 64  # query rows per program (query tokens x the heads sharing a KV head)
    block_n: int = 32  # context positions per tile
    num_warps: int = 4
    num_stages: int = 2


UNIFIED_TUNING = UnifiedTuning()

# A mixed batch (decode requests next to prefill chunks) runs its decode requests through the
# decode kernel and only the prefill chunks through the unified one: a unified program's
# BLOCK_M rows and short BLOCK_N tiles are shaped for many query tokens, and on a lone token
# they leave most of the tile empty while the context streams by (benchmarks/bench_attention_mixed.py).
SPLIT_MIXED_BATCHES = True


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The last request whose first tile number (query_start_loc[i] // BLOCK_Q + i) is <= tile."""
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_reqs - 1  # a tensor even when Triton specializes num_reqs == 1 to a constant
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,  # scale * log2(e)
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    HEADS_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # positions per KV cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * HEADS_PER_KV, rounded up to a power of two
    BLOCK_N: tl.constexpr,  # context positions per tile
    DOT_PRECISION: tl.constexpr,
    SKIP_DECODES: tl.constexpr,  # requests with one new token are the decode kernel's
    SKIP_FRESH: tl.constexpr,  # prompts with no cached prefix (and more than one token) are SDPA's
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= query_len:
        return  # a spare tile number past this request's last tile
    if SKIP_DECODES and query_len == 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len
    if SKIP_FRESH and context_len == 0 and query_len > 1:
        return

    offs_m = tl.arange(0, BLOCK_M)
    q_token = local_tile * BLOCK_Q + offs_m // HEADS_PER_KV  # [BLOCK_M] token within the request
    head = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * HEADS_PER_KV) & (q_token < query_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    q_rows = (q_start + q_token).to(tl.int64) * stride_q_tok + head * stride_q_head  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = context_len + q_token  # [BLOCK_M] position of each row's token: it sees [0, q_pos]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Causal bound of the tile's last token; every row sees position 0, so no row stays all -inf.
    kv_end = tl.minimum(seq_len, context_len + (local_tile + 1) * BLOCK_Q)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        n_valid = offs_n < kv_end
        block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slot = block.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # rescales what earlier tiles accumulated
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = (q_start + q_token).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out, mask=row_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_kernel(
    out_ptr,
    partial_out_ptr,  # [num_reqs, num_heads, num_splits, HEAD_PAD] float32 (SPLIT only)
    partial_max_ptr,  # [num_reqs, num_heads, num_splits] float32, base-2 scaled scores
    partial_sum_ptr,  # [num_reqs, num_heads, num_splits] float32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    decode_order_ptr,  # [num_reqs] int32: the request each program index takes (HAS_ORDER only)
    qk_scale,
    split_tokens,
    num_splits,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    HEADS_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # HEADS_PER_KV rounded up to a power of two, at least 16 (tl.dot)
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    DOT_PRECISION: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,  # the grid is (KV heads, requests, splits), else (requests, KV heads, splits)
    HAS_ORDER: tl.constexpr,
):
    if HEADS_FASTEST:
        kv_head = tl.program_id(0)
        req = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
    if HAS_ORDER:
        req = tl.load(decode_order_ptr + req)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - row != 1:
        return  # a request with no new token this step
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * split_tokens
    if start >= seq_len:
        return  # this split lies past the context: the reduce skips it
    end = tl.minimum(seq_len, start + split_tokens)

    offs_h = tl.arange(0, BLOCK_H)
    head = kv_head * HEADS_PER_KV + offs_h  # [BLOCK_H]
    h_valid = offs_h < HEADS_PER_KV
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    q_rows = row.to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=h_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slot = block.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        partial = (req * num_heads + head) * num_splits + split  # [BLOCK_H]
        tl.store(partial_out_ptr + partial[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=h_valid[:, None])
        tl.store(partial_max_ptr + partial, m_i, mask=h_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=h_valid)
    else:
        out_rows = row.to(tl.int64) * stride_o_tok + head * stride_o_head
        out = acc / l_i[:, None]
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out, mask=h_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    split_tokens,
    num_splits,
    num_heads,
    stride_o_tok,
    stride_o_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    """out = sum_s w_s * acc_s / sum_s w_s * l_s over the splits that ran, w_s = 2^(m_s - max_s m_s)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - row != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_valid = (seq_len + split_tokens - 1) // split_tokens
    offs_s = tl.arange(0, SPLITS_PAD)
    s_valid = offs_s < num_valid
    partial = (req * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(partial_max_ptr + partial, mask=s_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + partial, mask=s_valid, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # 0 for splits that did not run
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    acc = tl.load(
        partial_out_ptr + partial[:, None] * HEAD_PAD + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_PAD]
    out = tl.sum(acc * w[:, None], 0) / tl.sum(w * split_sum, 0)
    tl.store(out_ptr + row.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d, out, mask=d_valid)


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split the contexts of a grid too small to fill the GPU, only as far as needed to give
    every SM `programs_per_sm` programs."""
    tuning, sms = DECODE_TUNING, num_sms(device)
    max_splits = triton.cdiv(max_seq_len, _MIN_SPLIT_TOKENS)
    if num_programs >= tuning.split_below_per_sm * sms or max_splits <= 1:
        return 1
    return min(max_splits, triton.cdiv(tuning.programs_per_sm * sms, num_programs))


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, position, head) strides of one half of the cache, [num_blocks, block_size, nkv, hd]."""
    return cache.stride(0), cache.stride(1), cache.stride(2)


def _unified_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    skip_decodes: bool = False,
    skip_fresh: bool = False,
) -> None:
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    tuning = UNIFIED_TUNING
    block_m = max(tuning.block_m, triton.next_power_of_2(heads_per_kv))
    block_q = block_m // heads_per_kv
    head_pad = triton.next_power_of_2(head_size)
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *_cache_strides(kv_cache[0]),
        HEADS_PER_KV=heads_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=tuning.block_n if head_pad <= 128 else min(tuning.block_n, 32),
        DOT_PRECISION=dot_precision(query.dtype),
        SKIP_DECODES=skip_decodes,
        SKIP_FRESH=skip_fresh,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )


def _decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int,
    decode_order: torch.Tensor | None = None,
) -> None:
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    head_pad = triton.next_power_of_2(head_size)
    tuning = DECODE_TUNING
    block_n = tuning.block_n if head_pad <= 128 else min(tuning.block_n, 32)
    if num_splits <= 0:
        num_splits = choose_num_splits(num_reqs * num_kv_heads, max_seq_len, query.device)
    # Whole BLOCK_N tiles per split; a single split covers any context, whatever max_seq_len says.
    split_tokens = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), split_tokens)
    if num_splits == 1:
        split_tokens = 2**30
    # The program order pays in an unsplit grid, several programs per SM that run in waves. A
    # split grid (a small batch) keeps batch order and request-major numbering: there the sweep
    # measured either change slower in one of two calls (batch 64: 81 -> 136 us).
    reorder = num_splits == 1
    if not (reorder and tuning.longest_first):
        decode_order = None
    heads_fastest = reorder and tuning.heads_fastest
    partials = [query.new_empty(0, dtype=torch.float32)] * 3
    if num_splits > 1:
        partials = [
            query.new_empty(num_reqs, num_heads, num_splits, head_pad, dtype=torch.float32),
            query.new_empty(num_reqs, num_heads, num_splits, dtype=torch.float32),
            query.new_empty(num_reqs, num_heads, num_splits, dtype=torch.float32),
        ]
    grid = (num_kv_heads, num_reqs) if heads_fastest else (num_reqs, num_kv_heads)
    _decode_kernel[(*grid, num_splits)](
        out,
        *partials,
        query,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        query_start_loc,
        seq_lens if decode_order is None else decode_order,
        scale * LOG2E,
        split_tokens,
        num_splits,
        num_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *_cache_strides(kv_cache[0]),
        HEADS_PER_KV=heads_per_kv,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(heads_per_kv)),
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        DOT_PRECISION=dot_precision(query.dtype),
        HEADS_FASTEST=heads_fastest,
        HAS_ORDER=decode_order is not None,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out,
            *partials,
            seq_lens,
            query_start_loc,
            split_tokens,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            SPLITS_PAD=_reduce_width(num_splits),
            num_warps=4,
        )


# out, query, kv_cache, query_start_loc, seq_lens, block_tables: what every launch below takes first.
_BatchArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _with_fresh_prefills_by_sdpa(
    args: _BatchArgs,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: FreshPrefillPlan,
    max_seq_len: int,
    scale: float,
    num_splits: int,
    decode_order: torch.Tensor | None,
) -> None:
    """A batch with prefill tokens, each launch only where it has requests: the decode kernel for
    the one-token requests, SDPA for the fresh prompts, the unified kernel for the chunks after a
    cached prefix (and for the one-token requests too with SPLIT_MIXED_BATCHES off)."""
    out, query = args[0], args[1]
    if SPLIT_MIXED_BATCHES and plan.num_decodes > 0:
        _decode_attention(*args, max_seq_len, scale, num_splits, decode_order)  # skips the prefill requests
    fresh.fresh_prefill_attention(out, query, key, value, plan.groups, scale)
    if plan.num_prefix_chunks > 0 or (plan.num_decodes > 0 and not SPLIT_MIXED_BATCHES):
        _unified_attention(*args, scale, skip_decodes=SPLIT_MIXED_BATCHES, skip_fresh=True)


def triton_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int = 0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    fresh_prefill_plan: FreshPrefillPlan | None = None,
    decode_order: torch.Tensor | None = None,
) -> None:
    """The compiled op `paged_attention`: out [num_tokens, num_heads, head_size] (rows past the
    batch are left alone); kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]; int32
    query_start_loc [num_reqs + 1], seq_lens [num_reqs], block_tables [num_reqs, max_blocks].
    Requests with one new token take the split-K decode kernel, the others the unified one
    (or, with SPLIT_MIXED_BATCHES off, every request of a batch with prefill tokens);
    num_splits applies to the former (0: choose). Beyond the op's arguments: this step's key
    and value [num_tokens, num_kv_heads, head_size] and the batch's plan, all three or none,
    send the fresh prompts to SDPA (when `fresh_prefill_attention.BY_SDPA`); decode_order
    [num_reqs] int32, a permutation of the requests, is the order the decode kernel takes them
    in (longest context first balances its programs over the SMs)."""
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return
    args: _BatchArgs = (out, query, kv_cache, query_start_loc, seq_lens, block_tables)
    if max_query_len == 1:
        _decode_attention(*args, max_seq_len, scale, num_splits, decode_order)
    elif fresh.BY_SDPA and key is not None and value is not None and fresh_prefill_plan is not None:
        _with_fresh_prefills_by_sdpa(args, key, value, fresh_prefill_plan, max_seq_len, scale, num_splits, decode_order)
    elif SPLIT_MIXED_BATCHES:
        _decode_attention(*args, max_seq_len, scale, num_splits, decode_order)  # skips the prefill requests
        _unified_attention(*args, scale, skip_decodes=True)
    else:
        _unified_attention(*args, scale)
