"""`fused_moe_block_fp8` on the GPU (semantics and reference: shoal/kernels/fused_moe_block_fp8.py):
the bf16 fused-MoE pipeline of shoal/kernels/triton/fused_moe.py with fp8 operands.

1. The tokens' hidden states are quantized per group of block_k (`per_token_group_quant_fp8`).
2. `moe_align_block_size` sorts the entries by expert, as for bf16.
3. gate_up: the grouped GEMM below over the fp8 hidden states and w13, its K loop one scale
   group per step (BLOCK_SIZE_K = block_k), each step's product scaled by its rows' activation
   scales and its columns' weight-block scales; written in the model's dtype.
4. silu_and_mul, then its output quantized per group of block_k.
5. down: the same GEMM on those and w2, with the routing weights in the epilogue; then the
   top-k sum.

The tile rows, operands, epilogue and grid are the bf16 kernels' (`_tile_rows`,
`_tile_operands`, `_store_tile`, `moe_gemm_grid`). Launch configurations come from the fused-MoE
tables (fused_moe_config.py) for the dtype "float8_e4m3fn", with BLOCK_SIZE_K replaced by
block_k.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from shoal.kernels.fused_moe import local_expert_ids
from shoal.kernels.moe_align_block_size import moe_align_block_size
from shoal.kernels.per_token_group_quant_fp8 import per_token_group_quant_fp8
from shoal.kernels.silu_and_mul import silu_and_mul
from shoal.kernels.triton.fused_moe import _store_tile, _tile_operands, _tile_rows, moe_gemm_grid
from shoal.kernels.triton.fused_moe_config import MoEGemmConfig, MoELaunch, moe_launch_for
from shoal.kernels.triton.moe_sum import moe_sum


@triton.jit(do_not_specialize=["num_rows_padded", "num_entries"])
def _moe_gemm_block_fp8_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
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
    stride_asm,
    stride_asg,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsg,
    stride_cm,
    stride_cn,
    GROUP_N: tl.constexpr,
    A_ROWS_PER_ENTRY: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """c[entry, n] = sum_g a_scale[row, g] * b_scale[expert, n // GROUP_N, g] *
    (a[row, group g] . b[expert, n, group g]) (* weight[entry]), row = entry // A_ROWS_PER_ENTRY;
    b [num_experts, N, K] fp8, K contiguous; BLOCK_SIZE_K is block_k."""
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
    is_entry, a_rows, offs_n, offs_bn, offs_k, a_ptrs, b_ptrs = _tile_operands(
        a_ptr, b_ptr, entries, expert, pid_n, num_entries, N, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
        A_ROWS_PER_ENTRY, BLOCK_SIZE_N, BLOCK_SIZE_K,
    )  # fmt: skip
    a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
    b_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_bn // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - g * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=is_entry[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_scale = tl.load(a_scale_ptrs + g * stride_asg, mask=is_entry, other=0.0)
        b_scale = tl.load(b_scale_ptrs + g * stride_bsg)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    _store_tile(acc, c_ptr, topk_weights_ptr, entries, is_entry, offs_n, N, stride_cm, stride_cn, MUL_ROUTED_WEIGHT)


def invoke_moe_gemm_block_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_rows_per_entry: int,
    mul_routed_weight: bool,
    block_size_m: int,
    block_size: tuple[int, int],
    config: MoEGemmConfig,
) -> None:
    sorted_token_ids, expert_ids, num_tokens_post_padded = routing
    N, K = b.shape[1], b.shape[2]
    _moe_gemm_block_fp8_kernel[moe_gemm_grid(routing, block_size_m, N, config.block_size_n)](
        a, a_scale, b, b_scale, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        N, K, sorted_token_ids.numel(), c.shape[0],
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), b.stride(2), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        c.stride(0), c.stride(1),
        GROUP_N=block_size[0],
        A_ROWS_PER_ENTRY=a_rows_per_entry,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_SIZE_M=block_size_m,
        BLOCK_SIZE_N=config.block_size_n,
        BLOCK_SIZE_K=block_size[1],
        GROUP_SIZE_M=config.group_size_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def triton_fused_moe_block_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int],
    expert_map: torch.Tensor | None = None,
    launch: MoELaunch | None = None,
) -> torch.Tensor:
    """The registered "fused_moe_block_fp8": `fused_moe_block_fp8_ref`'s arguments and result.
    `launch` overrides the table (tests); its BLOCK_SIZE_K is replaced by block_k either way."""
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate2, hidden = w13.shape
    if launch is None:
        launch = moe_launch_for(num_experts, intermediate2 // 2, w13.dtype, hidden_states.device, num_tokens)
    # A table's gate_up width is that of each of the two products of the fused bf16 kernel; this
    # kernel computes gate and up as one product of twice the width.
    gate_up_config = dataclasses.replace(
        launch.gate_up, block_size_n=2 * launch.gate_up.block_size_n, block_size_k=block_size[1]
    )
    down_config = dataclasses.replace(launch.down, block_size_k=block_size[1])
    ids = local_expert_ids(topk_ids, expert_map)
    routing = moe_align_block_size(ids, num_experts, launch.block_size_m)
    weights = topk_weights.to(torch.float32).reshape(-1)  # [num_entries], entry = token * top_k + j
    num_entries = num_tokens * top_k
    device, dtype = hidden_states.device, hidden_states.dtype
    x_fp8, x_scale = per_token_group_quant_fp8(hidden_states, block_size[1])  # [num_tokens, hidden], [num_tokens, G]
    gate_up = torch.empty(num_entries, intermediate2, device=device, dtype=dtype)
    invoke_moe_gemm_block_fp8(x_fp8, x_scale, w13, w13_scale_inv, gate_up, weights, routing, top_k, False,
                              launch.block_size_m, block_size, gate_up_config)  # fmt: skip
    activated = torch.empty(num_entries, intermediate2 // 2, device=device, dtype=dtype)
    silu_and_mul(activated, gate_up)
    a2_fp8, a2_scale = per_token_group_quant_fp8(activated, block_size[1])
    # Choices of another rank's experts are never written: their rows must read as zero.
    alloc = torch.empty if expert_map is None else torch.zeros
    down = alloc(num_entries, hidden, device=device, dtype=dtype)
    invoke_moe_gemm_block_fp8(a2_fp8, a2_scale, w2, w2_scale_inv, down, weights, routing, 1, True,
                              launch.block_size_m, block_size, down_config)  # fmt: skip
    return moe_sum(down, top_k)  # [num_tokens, hidden]
