"""Run the LoRA shrink and expand Triton kernels under the interpreter on CPU tensors and compare
them with the per-token loop; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_lora_check
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.interpreter import prepare_interpreter
from tests.kernels.lora_cases import CASES, make_inputs, per_token_loop

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def main() -> int:
    prepare_interpreter()
    from shoal.kernels.triton.lora import triton_lora_expand, triton_lora_shrink

    failures = 0
    for case in CASES:
        x, lora_a, lora_b, y, slots = make_inputs(*case)
        out = triton_lora_expand(y.clone(), triton_lora_shrink(x, lora_a, slots), lora_b, slots)
        expected = per_token_loop(x, lora_a, lora_b, y, slots)
        tol = _TOLERANCE[case[-1]]
        ok = torch.allclose(out.float(), expected, rtol=tol, atol=tol) and torch.equal(out[slots < 0], y[slots < 0])
        print(f"{'ok  ' if ok else 'FAIL'} lora {case}")
        failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
