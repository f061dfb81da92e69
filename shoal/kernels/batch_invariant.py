"""Row-wise ops whose result for a row does not depend on the other rows of the batch: the
GEMMs, norms and router of `batch_invariant=True` (docs/batch_invariance.md).

A GEMM's row of x W^T is one dot product per output column, but which kernel computes it, and so
the order of its additions, may depend on the number of rows M: torch's CPU GEMM (MKL / oneDNN)
gives rows of M = 1 to 3 (and 5-7, 9-11 with two threads) other last bits than the same rows
in a larger M, and on a GPU cuBLAS picks tiles and split-K by M. Norms and softmaxes over a row are
reductions whose CPU parallel split depends on the tensor's size.

The CPU path here pads the rows to whole tiles of `ROW_TILE` rows: the GEMM runs once over
them, the norms and the activation tile by tile (so every reduction keeps one shape, and with
it its thread split and vector tail). A row's bits then depend neither on its slot in a tile
nor on the other rows, nor, for the GEMM, on the number of tiles
(tests/kernels/test_batch_invariant_ops.py checks all three on the machine it runs on). On CUDA each op is a
Triton kernel whose reduction order is fixed by its launch constants alone
(shoal/kernels/triton/batch_invariant.py): one program per row for the norm, a GEMM with one
tile configuration and no split-K for every M.

The sampler needs no twin: its softmaxes, sorts and cumulative sums run row by row with kernels
chosen by the row's length (checked on the CPU by the same test), and a seeded request draws
from its own generator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import registered_kernel

# Rows per tile of the CPU path. torch's CPU GEMM picks one kernel for every M >= 12 here; 16
# rows is a whole number of the AVX-512 GEMM's row blocks.
ROW_TILE = 16


def row_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [num_rows, ...] in tiles of ROW_TILE rows (the last padded with zeros), the
    results concatenated and cut back to num_rows. `fn` must treat rows independently."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return fn(x)
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    if padded != num_rows:
        x = torch.cat([x, x.new_zeros(padded - num_rows, *x.shape[1:])])
    return torch.cat([fn(tile) for tile in x.split(ROW_TILE)])[:num_rows]


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [num_rows, features]


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [num_rows, ...] with zero rows after it up to a whole number of ROW_TILE rows."""
    padded = max(ROW_TILE, -(-x.shape[0] // ROW_TILE) * ROW_TILE)
    if padded == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(padded - x.shape[0], *x.shape[1:])])


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) as one GEMM over the rows padded to whole tiles.

    One GEMM, not one per tile (which would pack the weight on every call). This leans on what
    the tests check: MKL gives a row the same bits in every M that is a whole number of tiles
    (up to 1024 rows, one and two threads, on this machine), whatever its slot; only some M
    below 16 pick other kernels (M = 1 to 3 here, and 5-7 and 9-11 with two threads)."""
    rows = _as_rows(x)
    out = F.linear(pad_rows(rows), weight, bias)[: rows.shape[0]]
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The batch-invariant GEMM: the Triton kernel "bi_matmul" on CUDA, `linear_ref` elsewhere."""
    kernel = registered_kernel("bi_matmul", x)
    if kernel is None:
        return linear_ref(x, weight, bias)
    rows = _as_rows(x).contiguous()
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    kernel(out, rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def silu_and_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * I] = [gate, up] (elementwise; over row tiles on the
    CPU, where an elementwise kernel's vector and scalar parts split a tensor by its size)."""
    half = gate_up.shape[-1] // 2
    rows = _as_rows(gate_up)
    if rows.is_cuda:
        out = F.silu(rows[:, :half]) * rows[:, half:]
    else:
        out = row_tiled(lambda tile: F.silu(tile[:, :half]) * tile[:, half:], rows)
    return out.view(*gate_up.shape[:-1], half)


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm, op by op: float32 statistics, back to x's dtype, times the weight."""
    x_fp32 = x.to(torch.float32)
    variance = x_fp32.pow(2).mean(-1, keepdim=True)
    return weight * (x_fp32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dimension, over row tiles."""
    return row_tiled(lambda tile: _normalize(tile, weight, eps), _as_rows(x)).view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The batch-invariant RMSNorm: one Triton program per row on CUDA ("bi_rms_norm")."""
    kernel = registered_kernel("bi_rms_norm", x)
    if kernel is None:
        return rms_norm_ref(x, weight, eps)
    rows = _as_rows(x).contiguous()
    out = torch.empty_like(rows)
    kernel(out, rows, weight, eps)
    return out.view(x.shape)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """`shoal.kernels.fused_moe.fused_moe_ref` with each expert's GEMMs batch-invariant (`linear`):
    an expert's rows are the tokens that chose it, a number the batch decides. A token's expert
    outputs are added in expert-id order whatever the batch: one index_add_ per expert, in which
    no token appears twice (so no two atomic adds meet on a GPU either)."""
    from shoal.kernels.fused_moe import local_expert_ids

    top_k = topk_ids.shape[1]
    num_local_experts = w13.shape[0]
    out = torch.zeros_like(hidden_states)
    ids = local_expert_ids(topk_ids, expert_map).flatten().long()  # [num_tokens * top_k]
    weights = topk_weights.flatten()
    for expert in ids[(ids >= 0) & (ids < num_local_experts)].unique().tolist():  # ascending
        chosen = torch.nonzero(ids == expert).flatten()  # this expert's entries, token order
        tokens = chosen // top_k
        activated = silu_and_mul_rows(linear(hidden_states[tokens], w13[expert], None))  # [count, I]
        expert_out = linear(activated, w2[expert], None)  # [count, hidden]
        out.index_add_(0, tokens, (expert_out * weights[chosen, None]).to(out.dtype))
    return out
