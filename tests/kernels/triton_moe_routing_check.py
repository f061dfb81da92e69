"""Run the routing kernel (`softmax_topk`) and the fused-MoE top-k reduction (`moe_sum`) under
Triton's interpreter on CPU tensors and compare them with their references; exits non-zero on a
mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_moe_routing_check

test_softmax_topk.py runs this in a subprocess (the interpreter is chosen when the kernels are
decorated, at import).
"""

from __future__ import annotations

import sys

import torch

# (num_tokens, num_experts, top_k, renormalize, dtype): Mixtral, Qwen1.5-MoE (60 experts: a
# padded row), Qwen3-MoE, DeepSeek-V2-Lite (top 6: padded choices), one token.
ROUTING_CASES = [
    (5, 8, 2, True, torch.float32),
    (7, 60, 4, False, torch.float16),
    (9, 128, 8, True, torch.float32),
    (3, 64, 6, False, torch.float32),
    (1, 16, 3, True, torch.float16),
]
# (num_tokens, top_k, hidden, dtype): hidden past one column block and not a multiple of it.
SUM_CASES = [(3, 8, 40, torch.float32), (5, 2, 1500, torch.float16), (1, 6, 16, torch.float32)]


def check_routing(num_tokens: int, num_experts: int, top_k: int, renormalize: bool, dtype: torch.dtype) -> bool:
    from shoal.kernels.softmax_topk import softmax_topk_ref
    from shoal.kernels.triton.softmax_topk import triton_softmax_topk

    logits = (torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 2).to(dtype)
    weights, ids = triton_softmax_topk(logits, top_k, renormalize)
    expected_weights, expected_ids = softmax_topk_ref(logits, top_k, renormalize)
    # Random logits have no ties: the same experts, in the same (descending) order.
    ok = ids.dtype == torch.int64 and torch.equal(ids, expected_ids)
    ok = ok and weights.dtype == torch.float32 and torch.allclose(weights, expected_weights, rtol=1e-6, atol=1e-7)
    print(f"{'ok  ' if ok else 'FAIL'} softmax_topk tokens={num_tokens} experts={num_experts} top_k={top_k} "
          f"renormalize={renormalize} {dtype}")  # fmt: skip
    return ok


def check_sum(num_tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> bool:
    from shoal.kernels.triton.moe_sum import moe_sum

    down = torch.randn(num_tokens * top_k, hidden, generator=torch.Generator().manual_seed(hidden)).to(dtype)
    expected = down.double().view(num_tokens, top_k, hidden).sum(dim=1)
    out = moe_sum(down, top_k)
    error = (out.double() - expected).abs().max().item()
    ok = (
        out.dtype == dtype and out.shape == (num_tokens, hidden) and error <= (1e-5 if dtype == torch.float32 else 1e-2)
    )
    print(f"{'ok  ' if ok else 'FAIL'} moe_sum tokens={num_tokens} top_k={top_k} hidden={hidden} {dtype}: "
          f"max error {error:.1e}")  # fmt: skip
    return ok


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    results = [check_routing(*case) for case in ROUTING_CASES] + [check_sum(*case) for case in SUM_CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
