"""Run the LoRA shrink and expand Triton kernels (per token, and over tokens sorted by slot) under
the interpreter on CPU tensors and compare them with the per-token loop; exits non-zero on a
mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_lora_check
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.interpreter import prepare_interpreter
from tests.kernels.lora_cases import CASES, SEGMENT_CASES, make_inputs, per_token_loop

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def main() -> int:
    prepare_interpreter()
    from shoal.kernels.triton.lora import triton_lora_expand, triton_lora_shrink
    from shoal.kernels.triton.lora_segments import triton_lora_expand_segments, triton_lora_shrink_segments
    from shoal.lora.layers import TokenSlots

    failures = 0
    for case in CASES + SEGMENT_CASES:
        x, lora_a, lora_b, y, slots = make_inputs(*case)
        segments = TokenSlots.of(slots, lora_a.shape[0]).segments
        outputs = {"per token": triton_lora_expand(y.clone(), triton_lora_shrink(x, lora_a, slots), lora_b, slots)}
        # Triton 3.6's interpreter multiplies bfloat16 operands of tl.dot as raw bits (a 16 x 16
        # product off by 1e10): the segment kernels' bfloat16 case runs on a GPU only.
        if case[-1] != torch.bfloat16:
            h = triton_lora_shrink_segments(x, lora_a, segments)
            outputs["segments"] = triton_lora_expand_segments(y.clone(), h, lora_b, segments)
        expected = per_token_loop(x, lora_a, lora_b, y, slots)
        tol = _TOLERANCE[case[-1]]
        for name, out in outputs.items():
            ok = torch.allclose(out.float(), expected, rtol=tol, atol=tol) and torch.equal(out[slots < 0], y[slots < 0])
            print(f"{'ok  ' if ok else 'FAIL'} lora {name} {case}")
            failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
