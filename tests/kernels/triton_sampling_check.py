"""Run the Triton Gumbel-max sampling kernel under Triton's interpreter on CPU tensors; exits
non-zero when its samples do not follow softmax(logits / T).

    TRITON_INTERPRET=1 python -m tests.kernels.triton_sampling_check
"""

from __future__ import annotations

import functools
import sys

import torch

from tests.kernels.gumbel_sample_cases import check_across_chunks, check_gumbel_sampler


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    from shoal.kernels.triton.sampling import triton_gumbel_sample

    # The interpreter runs one program at a time: few rows, loose bounds (a wrong temperature
    # still moves the top token's frequency by far more), and the GPU test samples 20,000 rows.
    cpu = torch.device("cpu")
    failures = check_gumbel_sampler(triton_gumbel_sample, cpu, num_rows=128, temperatures=(0.6, 1.7))
    # Rows split into chunks (as at batch 1) and a row in one piece, over a longer vocabulary.
    failures += check_across_chunks(functools.partial(triton_gumbel_sample, num_chunks=3), cpu, num_rows=32)
    failures += check_across_chunks(functools.partial(triton_gumbel_sample, num_chunks=1), cpu, num_rows=24)
    print("\n".join(failures) or "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
