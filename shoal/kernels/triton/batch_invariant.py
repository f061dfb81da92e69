"""Triton kernels of `batch_invariant=True`, each with its reduction order fixed by launch
constants that no batch changes (references: shoal/kernels/batch_invariant.py and
shoal/kernels/batch_invariant_attention.py; docs/batch_invariance.md).

- `triton_bi_matmul`: out = x W^T (+ bias) with one tile configuration for every M and no
  split-K: each output element is the sum over K in BLOCK_K steps, in order, whatever the number
  of rows. (cuBLAS chooses its kernel, tiles and split-K by M.) A row's slot in its BLOCK_M
  tile changes with the batch; a tensor-core product's sum for one element does not depend on
  its row in the tile.
- `triton_bi_rms_norm`: one program per row, the sum of squares accumulated in BLOCK-wide
  vectors over the row and then summed: the same order for a row alone or among thousands.
- `triton_bi_paged_attention`: one program per (request, query tile, KV head), query tiles at
  fixed absolute positions and KV_TILE-position context tiles walked from position 0, as many as
  the query tile's last position needs (shoal/kernels/batch_invariant_attention.py explains why
  that makes each token's output independent of chunking, neighbours and prefix-cache hits).

Softmax runs in base 2 (scores scaled by scale * log2(e), exp2 for exp), as in
shoal/kernels/triton/paged_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.batch_invariant_attention import KV_TILE, Q_TILE
from shoal.kernels.triton.precision import dot_precision

LOG2E = 1.4426950408889634
# The GEMM's one configuration (not tuned: a fixed choice is the point; tuning may change it for
# all M at once).
MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K = 64, 64, 64
MATMUL_WARPS, MATMUL_STAGES = 4, 3
NORM_BLOCK = 1024


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    num_rows,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < num_rows, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + offs_k
        k_valid = k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_x + k[None, :],
            mask=m_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_w + k[None, :],
            mask=n_valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def triton_bi_matmul(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]); rows contiguous in K."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("bi_matmul needs x and weight contiguous along K")
    grid = (triton.cdiv(num_rows, MATMUL_BLOCK_M), triton.cdiv(n, MATMUL_BLOCK_N))
    _matmul_kernel[grid](
        out, x, weight, bias if bias is not None else weight, num_rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N, BLOCK_K=MATMUL_BLOCK_K,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES,
    )  # fmt: skip


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, w_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    """Hugging Face's order: float32 statistics, the normalized row cast back, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < N, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / N + eps)
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < N, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=offs < N, other=0.0)
        y = (x * rstd).to(out_ptr.dtype.element_ty) * w
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


def triton_bi_rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out [num_rows, N] = rmsnorm(x) * weight, one program per row."""
    num_rows, n = x.shape
    if num_rows == 0:
        return
    block = min(NORM_BLOCK, triton.next_power_of_2(n))
    _rms_norm_kernel[(num_rows,)](out, x, weight, x.stride(0), out.stride(0), n, eps, BLOCK=block, num_warps=4)


@triton.jit
def _attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,  # scale * log2(e)
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
    Q_TILE: tl.constexpr,  # query positions per tile
    BLOCK_M: tl.constexpr,  # Q_TILE * HEADS_PER_KV rounded up to a power of two (>= 16)
    KV_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len
    if query_len <= 0:
        return  # a request with nothing to compute
    tile = context_len // Q_TILE + tl.program_id(1)  # absolute: positions [tile * Q_TILE, +Q_TILE)
    if tile * Q_TILE >= seq_len:
        return  # a tile number past this request's last

    offs_m = tl.arange(0, BLOCK_M)
    pos = tile * Q_TILE + offs_m // HEADS_PER_KV  # [BLOCK_M] token-major rows: a token's row is fixed
    head = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV
    row_valid = (offs_m < Q_TILE * HEADS_PER_KV) & (pos >= context_len) & (pos < seq_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_valid = offs_d < HEAD_SIZE
    q_rows = (q_start + pos - context_len).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    # The tile's context tiles up to its last position, however many of its rows this step has;
    # every row sees position 0, so none stays all -inf.
    num_kv_tiles = tl.cdiv((tile + 1) * Q_TILE, KV_TILE)
    for kv_tile in range(0, num_kv_tiles):
        offs_n = kv_tile * KV_TILE + tl.arange(0, KV_TILE)
        n_valid = offs_n < seq_len
        block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slot = block.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [KV_TILE, HEAD_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, KV_TILE]
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [KV_TILE, HEAD_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    out_rows = (q_start + pos - context_len).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out, mask=row_valid[:, None] & d_valid[None, :])


def triton_bi_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> None:
    """out, query [num_tokens, num_heads, head_size]; kv_cache [2, num_blocks, block_size, nkv,
    head_size] already holding this step's keys and values."""
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    # A chunk of q tokens starting anywhere spans at most ceil(q / Q_TILE) + 1 tiles.
    grid = (num_reqs, triton.cdiv(max_query_len, Q_TILE) + 1, num_kv_heads)
    cache = kv_cache[0]
    _attention_kernel[grid](
        out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2),
        HEADS_PER_KV=heads_per_kv, HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size, Q_TILE=Q_TILE, BLOCK_M=max(16, triton.next_power_of_2(Q_TILE * heads_per_kv)),
        KV_TILE=KV_TILE, DOT_PRECISION=dot_precision(query.dtype), num_warps=4, num_stages=2,
    )  # fmt: skip
