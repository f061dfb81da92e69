"""`gemv`: out = x W^T (+ bias) for a few rows of x (a decode step's tokens), W [N, K] row-major.

At batch 1 to 4 a linear layer is a read of its weight. cuBLAS reaches most of the memory
bandwidth on the wide MLP matrices but less on the narrow attention projections, where it splits
K into small tiles and adds a reduction kernel; the Triton kernel (shoal/kernels/triton/gemv.py)
reads each weight row once in wide tiles instead. `use_gemv` says for which shapes it is taken;
everything else, and every CPU or float32 tensor, stays with F.linear. `swiglu_linear` runs a
SwiGLU MLP's down projection with its activation folded into the kernel's read of x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import registered_kernel

GemvKernel = Callable[..., object]  # kernel(out, x, weight, bias, *, swiglu=False)

_DTYPES = (torch.float16, torch.bfloat16)


def gemv_ref(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N])."""
    out.copy_(F.linear(x, weight, bias))


def use_gemv(num_rows: int, n: int, k: int) -> bool:
    """Whether the Triton kernel beats F.linear for x [num_rows, k] and a weight [n, k].

    Set from benchmarks/bench_gemv.py on an H200 (bf16, 2026-12-01): at one row the kernel
    streams Llama-3.1-8B's qkv (6144 x 4096) in 14.1 us against cuBLAS's 16.2, o_proj (4096 x
    4096) in 10.9 us against 13.3 and down (4096 x 14336) in 28.8 us against 31.1; cuBLAS keeps
    the matrices with many rows (gate_up, the LM head: 85-100% of the copy rate already), every
    shape at two rows or more, and the small matrices of sub-1B models (not measured with these
    launch parameters).
    """
    return num_rows == 1 and n <= 8192 and n * k >= 8 * 2**20


def gemv_kernel_for(x: torch.Tensor, weight: torch.Tensor) -> GemvKernel | None:
    """The registered gemv kernel, called as kernel(out, x, weight, bias), when it serves x [M, K]
    times this weight: CUDA, float16 or bfloat16 in both, K contiguous, and a shape `use_gemv`
    takes. None: use F.linear."""
    if x.dim() != 2 or weight.dim() != 2 or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return None
    if not use_gemv(x.shape[0], weight.shape[0], weight.shape[1]) or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    # use_gemv stays within the rows the kernel takes (GemvTuning.max_rows; it asserts them).
    return registered_kernel("gemv", x)


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu(gate) * up @ weight [N, K]^T (+ bias) for gate_up [..., 2K] = [gate, up] (a SwiGLU
    MLP's activation and down projection) as one gemv launch, where `gemv_kernel_for` takes the
    rows; None otherwise (the caller runs silu_and_mul, then the linear). Fused, the activation
    costs no launch and no round trip of its [rows, K] output through memory."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    k = weight.shape[-1]
    if rows.shape[-1] != 2 * k:
        raise ValueError(f"gate_up has {rows.shape[-1]} features for a weight of {k} inputs (expected {2 * k})")
    kernel = gemv_kernel_for(rows[:, :k], weight)
    if kernel is None:
        return None
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    kernel(out, rows, weight, bias, swiglu=True)
    return out.view(*gate_up.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias): the gemv kernel where `gemv_kernel_for` takes x's
    rows (leading dims flattened), else F.linear."""
    rows = x.reshape(-1, x.shape[-1])
    kernel = gemv_kernel_for(rows, weight)
    if kernel is None:
        return F.linear(x, weight, bias)
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    kernel(out, rows, weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])
