"""`fused_moe` on the GPU: the routed experts as two grouped GEMMs over tokens sorted by expert
(semantics and reference: shoal/kernels/fused_moe.py).

1. `moe_align_block_size` (csrc) sorts the (token, choice) entries by expert and pads each
   expert's group to a multiple of BLOCK_SIZE_M rows, so that every block of BLOCK_SIZE_M rows
   belongs to one expert (`expert_ids[block]`).
2. gate_up with the activation: a program computes a [BLOCK_SIZE_M, BLOCK_SIZE_N] tile of both
   x[entry // top_k] @ W1[expert]^T (the gate) and x[entry // top_k] @ W3[expert]^T (up), the same
   columns of each, gathering its rows of x by `sorted_token_ids`, and writes silu(gate) * up at
   the entries' own rows (activated [num_entries, I]); padding rows are neither read nor written.
   Fused, the [num_entries, 2I] product is never written and read back, and one launch less runs.
3. down: the plain grouped GEMM on `activated` (its rows are the entries themselves) and w2, each
   row multiplied in the epilogue by its routing weight (cache [num_entries, hidden]).
4. The top-k reduction: out[t] = sum_j cache[t * top_k + j] (shoal/kernels/triton/moe_sum.py:
   float32 accumulation, deterministic, no atomics).

Launch configurations (tile sizes, warps, stages) depend on the number of tokens and are read
ahead of time from the tables in fused_moe_config.py, one per (experts, intermediate size,
dtype, device), tuned by benchmarks/tune_fused_moe.py (gate_up's BLOCK_SIZE_N counts the columns
of one of its two products). `warm_up` compiles every configuration a table can pick at engine
start-up. Integer arguments that change from step to step are in `do_not_specialize`, so a new
batch size never compiles a new variant. Nothing here reads back to the host, so a decode
step's launches can be captured in a CUDA graph.

The three kernels (gate_up, down, and the block-fp8 variant's) share `_tile_rows` (which rows
and expert a program owns), `_tile_operands` (the tile's pointers into a and b), `_store_tile`
(the routed-weight epilogue and the scattered store) and `moe_gemm_grid`; each has its own K
loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.fused_moe import local_expert_ids
from shoal.kernels.moe_align_block_size import moe_align_block_size
from shoal.kernels.triton.fused_moe_config import MoEGemmConfig, MoELaunch, moe_launch_for
from shoal.kernels.triton.moe_sum import moe_sum


@triton.jit
def _tile_rows(
    pid,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    num_rows_padded,
    N,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """The tile of program `pid`: (in_use, pid_n, entries [BLOCK_SIZE_M], expert). Programs run
    GROUP_SIZE_M row blocks per column of tiles so that consecutive programs share the expert's
    weight tiles in L2. `in_use` is False for row blocks past the padded groups (the grid is
    sized for the most rows any routing can need, so it does not depend on the routing)."""
    num_pid_m = tl.cdiv(num_rows_padded, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    in_use = pid_m * BLOCK_SIZE_M < tl.load(num_tokens_post_padded_ptr)
    # In use, the whole block lies inside the padded groups, whose length is a multiple of
    # BLOCK_SIZE_M and at most num_rows_padded: the loads need no mask.
    entries = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M), mask=in_use, other=0)
    expert = tl.load(expert_ids_ptr + pid_m, mask=in_use, other=0).to(tl.int64)
    return in_use, pid_n, entries, expert


@triton.jit
def _tile_operands(
    a_ptr,
    b_ptr,
    entries,
    expert,
    pid_n,
    num_entries,
    N,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    A_ROWS_PER_ENTRY: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
):
    """The tile's operands at the first K step: (is_entry, a_rows, offs_n, offs_bn, offs_k,
    a_ptrs [BLOCK_SIZE_M, BLOCK_SIZE_K], b_ptrs [BLOCK_SIZE_K, BLOCK_SIZE_N]). An entry reads row
    entry // A_ROWS_PER_ENTRY of a (top_k: its token's row of x; 1: its own row). Columns past N
    read row N - 1 again (in bounds, never stored): the loads of b need no mask on N."""
    is_entry = entries < num_entries  # padding rows hold num_entries
    a_rows = (entries // A_ROWS_PER_ENTRY).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    offs_bn = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    return is_entry, a_rows, offs_n, offs_bn, offs_k, a_ptrs, b_ptrs


def moe_gemm_grid(
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_size_m: int, n: int, block_size_n: int
) -> tuple[int]:
    """One program per (row block, column tile), sized for the most rows any routing can need."""
    return (triton.cdiv(routing[0].numel(), block_size_m) * triton.cdiv(n, block_size_n),)


@triton.jit
def _store_tile(
    acc,
    c_ptr,
    topk_weights_ptr,
    entries,
    is_entry,
    offs_n,
    N,
    stride_cm,
    stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr,
):
    """Write acc [BLOCK_SIZE_M, BLOCK_SIZE_N] at the rows of its entries (padding rows skipped),
    each multiplied by its entry's routing weight with MUL_ROUTED_WEIGHT."""
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + entries, mask=is_entry, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + entries.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=is_entry[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["num_rows_padded", "num_entries"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_rows_padded,
    num_entries,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[entry, n] = sum_k a[entry, k] * b[expert, n, k] (* weight[entry]) for the entries of this
    program's row block (the down projection: a row of `activated` per entry); b is
    [num_experts, N, K] (K contiguous). DOT_PRECISION is "ieee" for float32
    (tl.dot would round it to tf32, and float32 runs are compared with transformers exactly),
    "tf32" otherwise (ignored for half types)."""
    in_use, pid_n, entries, expert = _tile_rows(
        tl.program_id(0),
        sorted_token_ids_ptr,
        expert_ids_ptr,
        num_tokens_post_padded_ptr,
        num_rows_padded,
        N,
        BLOCK_SIZE_M,
        BLOCK_SIZE_N,
        GROUP_SIZE_M,
    )
    if not in_use:
        return
    is_entry, _, offs_n, _, offs_k, a_ptrs, b_ptrs = _tile_operands(
        a_ptr, b_ptr, entries, expert, pid_n, num_entries, N, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
        1, BLOCK_SIZE_N, BLOCK_SIZE_K,
    )  # fmt: skip
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=is_entry[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    _store_tile(acc, c_ptr, topk_weights_ptr, entries, is_entry, offs_n, N, stride_cm, stride_cn, MUL_ROUTED_WEIGHT)


@triton.jit(do_not_specialize=["num_rows_padded", "num_entries"])
def _moe_gate_up_silu_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_rows_padded,
    num_entries,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """c[entry, n] = silu(g) * u with g = a[entry // TOP_K] . b[expert, n] and
    u = a[entry // TOP_K] . b[expert, N + n], for n < N: b is w13 [num_experts, 2N, K] (gate rows,
    then up rows). Rounded as the unfused pipeline rounds (the product stored in c's dtype, then
    silu_and_mul: silu in float32 rounded to the dtype, times up, rounded again), so fusing
    changes no result."""
    in_use, pid_n, entries, expert = _tile_rows(
        tl.program_id(0),
        sorted_token_ids_ptr,
        expert_ids_ptr,
        num_tokens_post_padded_ptr,
        num_rows_padded,
        N,
        BLOCK_SIZE_M,
        BLOCK_SIZE_N,
        GROUP_SIZE_M,
    )
    if not in_use:
        return
    # The gate rows [0, N) of w13; up is the same columns N rows further.
    is_entry, _, offs_n, _, offs_k, a_ptrs, gate_ptrs = _tile_operands(
        a_ptr, b_ptr, entries, expert, pid_n, num_entries, N, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
        TOP_K, BLOCK_SIZE_N, BLOCK_SIZE_K,
    )  # fmt: skip
    up_ptrs = gate_ptrs + N * stride_bn
    gate = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=is_entry[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b_gate = tl.load(gate_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        b_up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        gate = tl.dot(a, b_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, b_up, up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        gate_ptrs += BLOCK_SIZE_K * stride_bk
        up_ptrs += BLOCK_SIZE_K * stride_bk
    dtype = c_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    _store_tile(activated, c_ptr, c_ptr, entries, is_entry, offs_n, N, stride_cm, stride_cn, False)


def invoke_moe_gate_up(
    a: torch.Tensor,
    w13: torch.Tensor,
    c: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    block_size_m: int,
    config: MoEGemmConfig,
) -> None:
    """c [num_entries, I] = silu(gate) * up of a's rows with w13 [num_experts, 2I, K] (see the
    kernel); `routing` is moe_align_block_size's."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = routing
    N, K = w13.shape[1] // 2, w13.shape[2]
    _moe_gate_up_silu_kernel[moe_gemm_grid(routing, block_size_m, N, config.block_size_n)](
        a, w13, c, sorted_token_ids, expert_ids, num_tokens_post_padded,
        N, K, sorted_token_ids.numel(), c.shape[0],
        a.stride(0), a.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), c.stride(0), c.stride(1),
        TOP_K=top_k,
        BLOCK_SIZE_M=block_size_m,
        BLOCK_SIZE_N=config.block_size_n,
        BLOCK_SIZE_K=config.block_size_k,
        GROUP_SIZE_M=config.group_size_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def invoke_moe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mul_routed_weight: bool,
    block_size_m: int,
    config: MoEGemmConfig,
) -> None:
    """c [num_entries, N] = the grouped GEMM of a's rows (one per entry) with b [num_experts, N, K]
    (see the kernel). `routing` is moe_align_block_size's (sorted_token_ids, expert_ids,
    num_tokens_post_padded)."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = routing
    N, K = b.shape[1], b.shape[2]
    _moe_gemm_kernel[moe_gemm_grid(routing, block_size_m, N, config.block_size_n)](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        N, K, sorted_token_ids.numel(), c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_SIZE_M=block_size_m,
        BLOCK_SIZE_N=config.block_size_n,
        BLOCK_SIZE_K=config.block_size_k,
        GROUP_SIZE_M=config.group_size_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def triton_fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    launch: MoELaunch | None = None,
) -> torch.Tensor:
    """The registered "fused_moe" kernel: `fused_moe_ref`'s arguments and result. `launch`
    overrides the tuned configuration (tests, the tuner)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate2, hidden = w13.shape
    if launch is None:
        launch = moe_launch_for(num_experts, intermediate2 // 2, hidden_states.dtype, hidden_states.device, num_tokens)
    ids = local_expert_ids(topk_ids, expert_map)
    routing = moe_align_block_size(ids, num_experts, launch.block_size_m)
    weights = topk_weights.to(torch.float32).reshape(-1)  # [num_entries], entry = token * top_k + j
    num_entries = num_tokens * top_k
    device, dtype = hidden_states.device, hidden_states.dtype
    activated = torch.empty(num_entries, intermediate2 // 2, device=device, dtype=dtype)
    invoke_moe_gate_up(hidden_states, w13, activated, routing, top_k, launch.block_size_m, launch.gate_up)
    # Choices of another rank's experts are never written: their rows must read as zero.
    alloc = torch.empty if expert_map is None else torch.zeros
    down = alloc(num_entries, hidden, device=device, dtype=dtype)
    invoke_moe_gemm(activated, w2, down, weights, routing, True, launch.block_size_m, launch.down)
    return moe_sum(down, top_k)  # [num_tokens, hidden]
