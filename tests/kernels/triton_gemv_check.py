"""Run the Triton gemv kernel under Triton's interpreter on CPU tensors and compare it with the
product in float64; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_gemv_check

test_gemv.py runs this in a subprocess, because the interpreter is chosen when the kernels are
decorated, at import. The kernel multiplies on the CUDA cores (no tl.dot), so bfloat16 runs
under the interpreter as well as float16; the interpreter rounds float32 to bfloat16 toward zero
(the GPU to nearest), hence bfloat16's looser bound.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

# (rows, N, K): N not a multiple of block_n, K a multiple of block_k or not, rows 1 to 5 and 8.
SHAPES = [(1, 37, 200), (2, 37, 256), (3, 16, 130), (4, 21, 64), (5, 9, 300), (8, 13, 128)]
DTYPES = (torch.float16, torch.bfloat16)


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    from shoal.kernels.triton.gemv import GemvTuning, triton_gemv

    # Small tiles so that the shapes above span several of them; then split-K (on CPU tensors
    # the kernel counts one SM, so programs_per_sm 16 splits every shape with several K tiles).
    tunings = [
        GemvTuning(block_n=8, block_k=64),
        GemvTuning(block_n=4, block_k=32, programs_per_sm=16, reduce_block=16),
    ]
    # Every tuning, shape and dtype; the four (bias, swiglu) combinations in turn across them
    # (each combination meets every tuning and dtype: the interpreter is slow).
    failures = 0
    flags = list(itertools.product((False, True), (False, True)))
    for i, (tuning, (rows, n, k), dtype) in enumerate(itertools.product(tunings, SHAPES, DTYPES)):
        has_bias, swiglu = flags[(i + i // len(DTYPES)) % len(flags)]
        failures += not check(triton_gemv, tuning, rows, n, k, dtype, has_bias, swiglu)
    return 1 if failures else 0


def check(triton_gemv, tuning, rows: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, swiglu: bool) -> bool:
    """With `swiglu` the kernel gets [gate, up] rows and must multiply by silu_and_mul's output."""
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, 2 * k if swiglu else k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if has_bias else None
    activated = silu_and_mul_as_interpreted(x) if swiglu else x
    expected = activated.double() @ weight.double().T + (bias.double() if bias is not None else 0)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    triton_gemv(out, x, weight, bias, tuning, swiglu=swiglu)
    # fp32 accumulation, one rounding to the output dtype: error relative to the output's scale.
    error = ((out.double() - expected).abs() / (expected.abs() + 1)).max().item()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    ok = error <= tol
    print(f"{'ok  ' if ok else 'FAIL'} rows={rows} n={n} k={k} {dtype} bias={has_bias} "
          f"swiglu={swiglu} block_n={tuning.block_n} block_k={tuning.block_k} programs_per_sm={tuning.programs_per_sm}: "
          f"max relative error {error:.2e}")  # fmt: skip
    return ok


def silu_and_mul_as_interpreted(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul's two roundings to x's dtype, toward zero for bfloat16 as the interpreter
    rounds (to nearest in float16): in float32, for the product above."""
    gate, up = x.float().chunk(2, dim=-1)
    activated = _round(F.silu(gate), x.dtype)
    return _round(activated * up, x.dtype)


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype != torch.bfloat16:
        return t.to(dtype).float()
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)  # drop the low 16 bits: toward zero


if __name__ == "__main__":
    sys.exit(main())
