"""Run the batch-invariant Triton kernels (shoal/kernels/triton/batch_invariant.py) under
Triton's interpreter on CPU tensors: each close to its torch reference, and a row's bits the
same whatever the batch; exits non-zero on a failure.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_batch_invariant_check

test_batch_invariant_ops.py runs this in a subprocess (the interpreter is chosen when the kernels
are decorated, at import) and calls `check_all` on a GPU.
"""

from __future__ import annotations

import os
import sys

# One BLAS thread for the interpreter's NumPy products (a busy machine stalls threaded ones).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F


def check_all(device: str, dtype: torch.dtype) -> list[str]:
    """The names of the failed checks."""
    failures = []
    for name, check in (("matmul", _check_matmul), ("rms_norm", _check_rms_norm), ("attention", _check_attention)):
        try:
            check(device, dtype)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    return failures


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def _check_matmul(device: str, dtype: torch.dtype) -> None:
    from shoal.kernels.triton.batch_invariant import triton_bi_matmul

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 100, generator=gen).to(dtype).to(device)  # K past one BLOCK_K, M past one BLOCK_M
    weight = (torch.randn(80, 100, generator=gen) * 0.1).to(dtype).to(device)
    bias = torch.randn(80, generator=gen).to(dtype).to(device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        triton_bi_matmul(out, rows, weight, bias)
        return out

    full = run(x)
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float(), bias.float()), **_tolerance(dtype))
    assert all(torch.equal(run(x[:m]), full[:m]) for m in (1, 3, 17)), "rows differ with the batch"


def _check_rms_norm(device: str, dtype: torch.dtype) -> None:
    from shoal.kernels.batch_invariant import rms_norm_ref
    from shoal.kernels.triton.batch_invariant import triton_bi_rms_norm

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(20, 1100, generator=gen) * 3).to(dtype).to(device)  # more than one NORM_BLOCK
    weight = (torch.rand(1100, generator=gen) + 0.5).to(dtype).to(device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        triton_bi_rms_norm(out, rows, weight, 1e-5)
        return out

    full = run(x)
    torch.testing.assert_close(full.float(), rms_norm_ref(x, weight, 1e-5).float(), **_tolerance(dtype))
    assert all(torch.equal(run(x[:m]), full[:m]) for m in (1, 7)), "rows differ with the batch"


def _check_attention(device: str, dtype: torch.dtype) -> None:
    from shoal.kernels.batch_invariant_attention import paged_attention_ref
    from shoal.kernels.triton.batch_invariant import triton_bi_paged_attention
    from tests.kernels.batch_invariant_cases import SCHEDULES, AttentionCase, check_schedules_agree

    def kernel(query, kv_cache, md, scale):
        out = torch.zeros_like(query)
        triton_bi_paged_attention(
            out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len, scale
        )
        return out

    case = AttentionCase(4, 2, 16, block_size=4, dtype=dtype, device=device)
    assert check_schedules_agree(kernel, case) == [], "outputs differ with the schedule"
    expected = case.run(paged_attention_ref, SCHEDULES["chunked"])
    torch.testing.assert_close(case.run(kernel, SCHEDULES["chunked"]).float(), expected.float(), **_tolerance(dtype))


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    torch.set_num_threads(1)
    failures = check_all("cpu", torch.float32)
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
