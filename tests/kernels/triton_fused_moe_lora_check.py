"""Run the Triton `fused_moe_lora` under Triton's interpreter on CPU tensors and compare it with
the formula; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_fused_moe_lora_check

test_fused_moe_lora.py runs this in a subprocess. float32, small tiles, a partial row block;
one case with expert parallelism (the rank holds the second half of the experts).
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    from shoal.kernels.triton.fused_moe_config import MoEGemmConfig, MoELaunch
    from shoal.kernels.triton.fused_moe_lora import triton_fused_moe_lora
    from tests.kernels.fused_moe_lora_cases import formula, make_inputs

    launch = MoELaunch(16, MoEGemmConfig(16, 16, group_size_m=1), MoEGemmConfig(16, 16, group_size_m=1))
    failures = 0
    for expert_parallel in (False, True):
        inputs = make_inputs(5, 4, 2, 32, 16, num_slots=2, rank=8, seed=3)
        if expert_parallel:
            inputs["expert_map"] = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
            for key in ("w13", "w2"):
                inputs[key] = inputs[key][2:].contiguous()
            for key in ("gate_up_a", "gate_up_b", "down_a", "down_b"):
                inputs[key] = inputs[key][:, 2:].contiguous()
        expected = formula(inputs)
        out = triton_fused_moe_lora(*inputs.values(), launch=launch)
        error = ((out.double() - expected).abs() / (expected.abs() + 1)).max().item()
        ok = out.shape == expected.shape and error <= 1e-5
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} ep={expert_parallel}: max relative error {error:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
