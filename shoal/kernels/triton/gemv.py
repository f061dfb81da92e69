"""`gemv`: out = x W^T (+ bias) for a few rows of x, as a Triton kernel bound by the weight read
(semantics and reference: shoal/kernels/gemv.py; when it is used: `use_gemv` there).

At decode batch sizes a linear layer reads its whole weight to produce a handful of outputs, so
its time is the weight's bytes over the memory bandwidth. The kernel is built around that read:

- A program owns BLOCK_N consecutive rows of W [N, K] (K contiguous) and every row of x, so each
  weight element is loaded exactly once, as 16-byte loads along K (BLOCK_K elements per row and
  tile, marked evict-first: nothing reads them again).
- The products are formed on the CUDA cores in fp32: up to 4 rows of x this is well below the
  FMA rate (8 rows: about half of it at full bandwidth), and it needs no padding of the rows to
  a tensor-core tile.
  Each row of x has its own accumulator of per-thread partial sums, laid out like the weight
  tile, so the loop body is loads and FMAs only (no layout conversion, shuffle or barrier); the
  reduction across threads runs once, after the loop. x is re-read per tile from L1.
- Tiles are K-major, [BLOCK_K // VEC, BLOCK_N, VEC]: a warp's threads take consecutive 16-byte
  vectors of a weight row (512 contiguous bytes per load instruction) and each thread holds its
  vector position for all BLOCK_N rows, as long as BLOCK_K // VEC >= 32 * num_warps.
- SWIGLU: x's row is [gate, up] of a SwiGLU MLP and the kernel multiplies by silu(gate) * up,
  so the activation needs no launch of its own. Each thread activates its vector once for all
  its rows (silu costs two special-function operations per element; once per weight element
  it would rival the weight stream for those units).
- Row indices past N are clamped rather than masked, so the loads of a tile are unmasked
  whenever K is a multiple of BLOCK_K; only the store is masked. The kernel is compiled per
  number of rows (1 to 8).
- Split-K: when the N tiles alone give fewer than `programs_per_sm` programs per SM, the K tiles
  are divided over a second grid axis. Each split writes an fp32 partial sum to a workspace and a
  second small kernel adds them up (with the bias), so the result does not depend on the order in
  which programs finish (no atomics).

Nothing here reads a value back to the host, so the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels.triton import num_sms


@dataclass
class GemvTuning:
    """Launch parameters of the gemv kernel (benchmarks/bench_gemv.py --sweep sweeps them)."""

    block_n: int = 4  # weight rows (outputs) per program (sweep: 4 beats 8 and 16 at one row)
    block_k: int = 512  # weight columns per tile: 1 KiB of bf16 per row and tile
    num_warps: int = 4
    num_stages: int = 3  # passed to the compiler (triton 3.6 pipelines no load that feeds no dot)
    max_rows: int = 8  # rows of x the kernel takes (use_gemv sends no more)
    programs_per_sm: int = 0  # split K until the grid has this many programs per SM; 0: never split
    reduce_block: int = 1024  # outputs per program of the split-K reduction


GEMV_TUNING = GemvTuning()
# Rows of 8,192 columns or more (an MLP's down projection): 2-row programs, 1,024-column tiles.
# Llama-3.1-8B's down (4096 x 14336) at one row, one H200: 28.1 us (98% of the copy rate)
# against cuBLAS's 31.2 (bench_gemv.py --models llama-8b --m 1).
LONG_ROW_TUNING = GemvTuning(block_n=2, block_k=1024, num_warps=4)
# With silu_and_mul fused (SWIGLU), 4-row programs: the same down projection in 29.1 us against
# 34.9 for silu_and_mul then cuBLAS, and 35.6 with LONG_ROW_TUNING (bench_gemv.py --sweep --swiglu
# --shapes "llama-8b down"). 1,024-column tiles are 128 vectors, one per thread of 4 warps, so
# each thread holds all 4 rows of its vector and activates it once; with 8 warps the rows split
# across warps and the activation is shared through memory (270-530 us).
SWIGLU_TUNING = GemvTuning(block_n=4, block_k=1024, num_warps=4)


def tuning_for(k: int, swiglu: bool = False) -> GemvTuning:
    """The launch parameters for weight rows of k columns."""
    if swiglu:
        return SWIGLU_TUNING
    return LONG_ROW_TUNING if k >= 8192 else GEMV_TUNING


@triton.jit
def _load_x(x_ptrs, in_k, K, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
    """A tile of x's row in float32; with SWIGLU the row holds [gate (K), up (K)] and the tile is
    silu(gate) * up, rounded as the separate silu_and_mul op rounds (silu to x's dtype, then the
    product)."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=in_k, other=0.0)
    if SWIGLU:
        if EVEN_K:
            up = tl.load(x_ptrs + K)
        else:
            up = tl.load(x_ptrs + K, mask=in_k, other=0.0)
        # The tile's rows (axis 1) hold copies of one vector: activate one copy, not each.
        gate = tl.max(x, axis=1).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(x.dtype).to(tl.float32)
        x = (activated * tl.max(up, axis=1).to(tl.float32)).to(x.dtype)[:, None, :]
    return x.to(tl.float32)


@triton.jit
def _accumulate(acc, w, x_ptrs, in_k, K, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr):
    """acc [BLOCK_K // VEC, BLOCK_N] += w * x summed over each thread's VEC-wide vectors only."""
    return acc + tl.sum(w * _load_x(x_ptrs, in_k, K, EVEN_K, SWIGLU), axis=2)


@triton.jit
def _store_row(out_ptrs, acc, bias, mask, HAS_BIAS: tl.constexpr):
    result = tl.sum(acc, axis=0)
    if HAS_BIAS:
        result += bias
    tl.store(out_ptrs, result.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_split,
    k_per_split,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """out[split, m, n] = sum over this split's k of x[m, k] * w[n, k] for m < ROWS (1 to 8),
    plus the bias and cast to out's dtype when there is one split (stride_split 0), an fp32
    partial otherwise.

    Tiles are [BLOCK_K // VEC, BLOCK_N, VEC] so that a thread's VEC consecutive elements (one
    16-byte load) sit on their own axis: each row of x keeps an accumulator of per-vector partial
    sums in the weight tile's own layout, and x is loaded in that same shape (stride 0 across
    the weight rows). The loop body is loads and FMAs only, with no layout conversion, shuffle
    or barrier; the one reduction across threads happens after it.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N load (a duplicate of) row N - 1 and are never stored: no row mask on the loads.
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K // VEC)[:, None, None] * VEC + tl.arange(0, VEC)[None, None, :]
    w_ptrs = w_ptr + rows_n[None, :, None] * stride_wn + offs_k  # [BLOCK_K // VEC, BLOCK_N, VEC]
    x_ptrs = x_ptr + (offs_n * 0)[None, :, None] + offs_k  # row 0 of x, broadcast over the tile's rows

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc0 = tl.zeros([BLOCK_K // VEC, BLOCK_N], dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    for k in range(k_start, k_end, BLOCK_K):
        in_k = offs_k + k < K
        if EVEN_K:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k, mask=in_k, other=0.0, eviction_policy="evict_first")
        w = w.to(tl.float32)
        acc0 = _accumulate(acc0, w, x_ptrs + k, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 1:
            acc1 = _accumulate(acc1, w, x_ptrs + k + stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 2:
            acc2 = _accumulate(acc2, w, x_ptrs + k + 2 * stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 3:
            acc3 = _accumulate(acc3, w, x_ptrs + k + 3 * stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 4:
            acc4 = _accumulate(acc4, w, x_ptrs + k + 4 * stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 5:
            acc5 = _accumulate(acc5, w, x_ptrs + k + 5 * stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 6:
            acc6 = _accumulate(acc6, w, x_ptrs + k + 6 * stride_xm, in_k, K, EVEN_K, SWIGLU)
        if ROWS > 7:
            acc7 = _accumulate(acc7, w, x_ptrs + k + 7 * stride_xm, in_k, K, EVEN_K, SWIGLU)

    bias = tl.load(bias_ptr + rows_n).to(tl.float32) if HAS_BIAS else None
    out_ptrs = out_ptr + pid_k * stride_split + offs_n
    mask = offs_n < N
    _store_row(out_ptrs, acc0, bias, mask, HAS_BIAS)
    if ROWS > 1:
        _store_row(out_ptrs + stride_om, acc1, bias, mask, HAS_BIAS)
    if ROWS > 2:
        _store_row(out_ptrs + 2 * stride_om, acc2, bias, mask, HAS_BIAS)
    if ROWS > 3:
        _store_row(out_ptrs + 3 * stride_om, acc3, bias, mask, HAS_BIAS)
    if ROWS > 4:
        _store_row(out_ptrs + 4 * stride_om, acc4, bias, mask, HAS_BIAS)
    if ROWS > 5:
        _store_row(out_ptrs + 5 * stride_om, acc5, bias, mask, HAS_BIAS)
    if ROWS > 6:
        _store_row(out_ptrs + 6 * stride_om, acc6, bias, mask, HAS_BIAS)
    if ROWS > 7:
        _store_row(out_ptrs + 7 * stride_om, acc7, bias, mask, HAS_BIAS)


@triton.jit
def _gemv_reduce_kernel(
    out_ptr, partial_ptr, bias_ptr, N, stride_om, stride_split, num_splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[m, n] = sum over splits of partial[split, m, n] (+ bias[n]); partial [splits, M, N] fp32."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs_n < N
    ptrs = partial_ptr + m * N + offs_n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(num_splits):
        acc += tl.load(ptrs, mask=valid, other=0.0)
        ptrs += stride_split
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=valid)


def _k_per_split(n_programs: int, k: int, device: torch.device, tuning: GemvTuning) -> int:
    """Columns of K per split, a multiple of block_k (all of K: no split)."""
    k_tiles = triton.cdiv(k, tuning.block_k)
    if tuning.programs_per_sm <= 0 or k_tiles == 1:
        return k_tiles * tuning.block_k
    target = tuning.programs_per_sm * num_sms(device, on_cpu=1)  # interpreter: split as on a 1-SM device
    splits = min(triton.cdiv(target, n_programs), k_tiles)
    return triton.cdiv(k_tiles, splits) * tuning.block_k


def triton_gemv(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tuning: GemvTuning | None = None,
    *,
    swiglu: bool = False,
) -> None:
    """out [M, N] = x [M, K] @ weight[N, K]^T (+ bias [N]); x and weight K-contiguous, out
    N-contiguous, M <= tuning.max_rows. With `swiglu`, x is [M, 2K] = [gate, up] and the product
    takes silu(gate) * up for x (the down projection of a SwiGLU MLP, its activation fused)."""
    tuning = tuning or tuning_for(weight.shape[1], swiglu)
    rows = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if swiglu else k), f"x has {x.shape[1]} columns for a weight of {k}"
    assert rows <= tuning.max_rows, f"gemv takes at most {tuning.max_rows} rows, got {rows}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and out.stride(1) == 1
    if rows == 0 or n == 0:
        return
    if k == 0:  # an empty sum
        out.copy_(bias.expand(rows, n) if bias is not None else torch.zeros_like(out))
        return
    n_programs = triton.cdiv(n, tuning.block_n)
    k_per_split = _k_per_split(n_programs, k, x.device, tuning)
    splits = max(1, triton.cdiv(k, k_per_split))
    common = {
        "ROWS": rows,
        "BLOCK_N": tuning.block_n,
        "BLOCK_K": tuning.block_k,
        "VEC": min(16 // x.element_size(), tuning.block_k),
        "EVEN_K": k % tuning.block_k == 0,
        "SWIGLU": swiglu,
        "num_warps": tuning.num_warps,
        "num_stages": tuning.num_stages,
    }
    if splits == 1:
        _gemv_kernel[(n_programs, 1)](
            out, x, weight, bias, n, k, x.stride(0), weight.stride(0), out.stride(0), 0, k_per_split,
            HAS_BIAS=bias is not None, **common,
        )  # fmt: skip
        return
    partial = torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(n_programs, splits)](
        partial, x, weight, None, n, k, x.stride(0), weight.stride(0), n, rows * n, k_per_split,
        HAS_BIAS=False, **common,
    )  # fmt: skip
    _gemv_reduce_kernel[(rows, triton.cdiv(n, tuning.reduce_block))](
        out, partial, bias, n, out.stride(0), rows * n, splits, HAS_BIAS=bias is not None, BLOCK=tuning.reduce_block
    )
