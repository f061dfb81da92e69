"""Run the Triton fused-MoE kernels under Triton's interpreter on CPU tensors and compare them
with `fused_moe_ref`; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_fused_moe_check

test_fused_moe.py runs this in a subprocess (the interpreter is chosen when the kernels are
decorated, at import). float32 and float16: the interpreter's tl.dot on bfloat16 multiplies the
raw bits (bfloat16 is covered by the GPU test). Small tiles, so that the shapes span several
row blocks, column tiles and K steps, with partial ones.
"""

from __future__ import annotations

import sys

import torch

# (num_tokens, num_experts, top_k, hidden, intermediate): one token; more experts than entries
# (empty groups); hidden and intermediate not multiples of the tiles.
SHAPES = [(1, 4, 2, 32, 16), (7, 8, 2, 48, 24), (33, 4, 3, 40, 20)]


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    from shoal.kernels.triton.fused_moe_config import MoEGemmConfig, MoELaunch

    launches = [
        MoELaunch(16, MoEGemmConfig(16, 16, group_size_m=1), MoEGemmConfig(16, 32, group_size_m=2)),
        MoELaunch(32, MoEGemmConfig(32, 16, group_size_m=4), MoEGemmConfig(16, 16, group_size_m=1)),
    ]
    # Every shape with the first launch in float32; float16 with expert parallelism, and the
    # second launch, on one shape each (the interpreter takes seconds a case).
    cases = [(launches[0], shape, torch.float32, False) for shape in SHAPES]
    cases += [(launches[0], SHAPES[2], torch.float16, True), (launches[1], SHAPES[1], torch.float32, True)]
    failures = 0
    for launch, shape, dtype, expert_parallel in cases:
        failures += not check(launch, *shape, dtype, expert_parallel)
    return 1 if failures else 0


def check(launch, num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
          dtype: torch.dtype, expert_parallel: bool) -> bool:  # fmt: skip
    """With `expert_parallel` the rank holds the second half of the experts (expert_map)."""
    from shoal.kernels.fused_moe import fused_moe_ref
    from shoal.kernels.triton.fused_moe import triton_fused_moe

    generator = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    num_local = num_experts // 2 if expert_parallel else num_experts
    w13 = (torch.randn(num_local, 2 * intermediate, hidden, generator=generator) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, intermediate, generator=generator) * intermediate**-0.5).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    expert_map = None
    if expert_parallel:
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[num_local:] = torch.arange(num_local, dtype=torch.int32)
    expected = fused_moe_ref(x.double(), w13.double(), w2.double(), topk_weights, topk_ids, expert_map)
    out = triton_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, launch=launch)
    error = ((out.double() - expected).abs() / (expected.abs() + 1)).max().item()
    ok = (
        out.dtype == dtype and out.shape == (num_tokens, hidden) and error <= (1e-5 if dtype == torch.float32 else 5e-3)
    )
    print(f"{'ok  ' if ok else 'FAIL'} tokens={num_tokens} experts={num_experts} top_k={top_k} hidden={hidden} "
          f"intermediate={intermediate} {dtype} ep={expert_parallel} block_m={launch.block_size_m}: "
          f"max relative error {error:.2e}")  # fmt: skip
    return ok


if __name__ == "__main__":
    sys.exit(main())
