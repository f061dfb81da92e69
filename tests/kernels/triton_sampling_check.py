"""Run the Triton Gumbel-max sampling kernel under Triton's interpreter on CPU tensors; exits
non-zero when its samples do not follow softmax(logits / T).

    TRITON_INTERPRET=1 python -m tests.kernels.triton_sampling_check
"""

from __future__ import annotations

import os
import sys

import torch

from tests.kernels.gumbel_sample_cases import check_gumbel_sampler


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from tests.kernels.triton_interpreter_check import _patch_interpreter_for_numpy_2_4

    _patch_interpreter_for_numpy_2_4()
    from shoal.kernels.triton.sampling import triton_gumbel_sample

    # The interpreter runs one program at a time: few rows, loose bounds (a wrong temperature
    # still moves the top token's frequency by far more), and the GPU test samples 20,000 rows.
    failures = check_gumbel_sampler(triton_gumbel_sample, torch.device("cpu"), num_rows=400, temperatures=(0.6, 1.7))
    print("\n".join(failures) or "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
