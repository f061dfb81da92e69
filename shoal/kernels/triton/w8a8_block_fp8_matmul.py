"""`w8a8_block_fp8_matmul` on the GPU (semantics and reference:
shoal/kernels/w8a8_block_fp8_matmul.py): a tiled GEMM over fp8 operands whose K loop steps one
scale group at a time (BLOCK_SIZE_K = block_k), so that each step's fp8 product, accumulated by
tl.dot in float32, is scaled by the activations' scale of its rows and the weight's scale of its
columns' blocks before it joins the accumulator:

    acc[m, n] += (a[m, k0:k1] . b[n, k0:k1]) * a_scale[m, g] * b_scale[n // block_n, g]

Tiles run GROUP_SIZE_M row blocks per column of tiles, so consecutive programs share weight
tiles in L2. Tile sizes come from the launch table of the weight's shape
(shoal/kernels/triton/block_fp8_config.py); M is in `do_not_specialize`, so a new batch size
compiles nothing, and nothing reads back to the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.triton.block_fp8_config import BlockFp8Launch, launch_table, nearest_launch
from shoal.kernels.triton.fused_moe_config import device_name


@triton.jit(do_not_specialize=["M"])
def _w8a8_block_fp8_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    GROUP_N: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """c [M, N] = the scaled product of a [M, K] and b [N, K]; GROUP_N is block_n and
    BLOCK_SIZE_K block_k (one K step per scale group)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    # Rows past M and columns past N read the last row / column again (in bounds, never stored):
    # the loads need no mask but K's.
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    b_scale_ptrs = b_scale_ptr + (cols // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - g * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_scale = tl.load(a_scale_ptrs + g * stride_asg)
        b_scale = tl.load(b_scale_ptrs + g * stride_bsg)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def launch_for(n: int, k: int, device: torch.device, block_size: tuple[int, int], num_tokens: int) -> BlockFp8Launch:
    return nearest_launch(launch_table(n, k, device_name(device), block_size), num_tokens)


def triton_w8a8_block_fp8_matmul(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    launch: BlockFp8Launch | None = None,
) -> None:
    """The registered "w8a8_block_fp8_matmul": out [M, N] = the scaled a [M, K] @ b [N, K]^T.
    `launch` overrides the table (tests)."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0:
        return
    if launch is None:
        launch = launch_for(n, k, a.device, (block_n, block_k), m)
    grid = (triton.cdiv(m, launch.block_size_m) * triton.cdiv(n, launch.block_size_n),)
    _w8a8_block_fp8_matmul_kernel[grid](
        a, b, out, a_scale, b_scale, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        GROUP_N=block_n,
        BLOCK_SIZE_M=launch.block_size_m,
        BLOCK_SIZE_N=launch.block_size_n,
        BLOCK_SIZE_K=block_k,
        GROUP_SIZE_M=launch.group_size_m,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
