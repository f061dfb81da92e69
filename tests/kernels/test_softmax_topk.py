"""`softmax_topk` (the routing of Mixtral and Qwen-MoE) and the fused-MoE top-k reduction: the
reference against the routing rule, the Triton kernels under the interpreter (CPU) and on a GPU
over the shipped families' shapes, with ties, inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.dispatch import has_op
from shoal.kernels.softmax_topk import softmax_topk, softmax_topk_ref
from shoal.layers.moe.routing import RoutingConfig, select_experts
from tests.kernels.interpreter import needs_triton, run_interpreter_check


def test_reference_is_the_routing_rule() -> None:
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    weights, ids = softmax_topk(logits, 3, renormalize=False)  # CPU: the reference
    scores = torch.exp(logits.double()) / torch.exp(logits.double()).sum(-1, keepdim=True)
    for t in range(6):
        best = sorted(range(10), key=lambda e: -scores[t, e].item())[:3]
        assert ids[t].tolist() == best
        torch.testing.assert_close(weights[t].double(), scores[t, best], rtol=1e-6, atol=1e-7)
    renormalized, same_ids = softmax_topk(logits, 3, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(renormalized, weights / weights.sum(-1, keepdim=True))


def test_select_experts_scales_what_softmax_topk_chose() -> None:
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    config = RoutingConfig(16, 6, routed_scaling_factor=2.5)  # DeepSeek-V2-Lite's greedy rule
    weights, ids = select_experts(logits, config)
    expected_weights, expected_ids = softmax_topk_ref(logits, 6, renormalize=False)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, 2.5 * expected_weights)


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_moe_routing_check")


# ---- GPU -------------------------------------------------------------------------------------


def _distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Each row a random permutation of num_experts values evenly spaced over [-4, 4): steps of
    at least 1/64 for up to 512 experts, exact in bfloat16, so no two experts tie."""
    gen = torch.Generator("cuda").manual_seed(seed)
    ranks = torch.rand(num_tokens, num_experts, device="cuda", generator=gen).argsort(dim=-1)
    return (ranks.float() * (8.0 / num_experts) - 4.0).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 8192])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "renormalize"),
    [(8, 2, True), (60, 4, False), (128, 8, True), (64, 6, False), (512, 10, True)],
)
def test_triton_matches_reference_on_gpu(dtype, num_tokens, num_experts, top_k, renormalize) -> None:
    """Distinct logits: the same experts in the same order, and weights within float32 rounding."""
    logits = _distinct_logits(num_tokens, num_experts, dtype, seed=num_tokens)
    assert has_op("softmax_topk", logits)
    weights, ids = softmax_topk(logits, top_k, renormalize)
    expected_weights, expected_ids = softmax_topk_ref(logits, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.gpu
def test_ties_take_the_lowest_expert_first_on_gpu() -> None:
    logits = torch.zeros(3, 16, device="cuda", dtype=torch.bfloat16)
    logits[1, 5] = 1.0
    weights, ids = softmax_topk(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [5, 0, 1, 2], [0, 1, 2, 3]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, device="cuda"))


@pytest.mark.gpu
def test_routing_and_sum_in_a_cuda_graph() -> None:
    from shoal.kernels.triton.moe_sum import moe_sum

    logits = _distinct_logits(64, 128, torch.bfloat16, seed=0)
    down = torch.randn(64 * 8, 2048, device="cuda", dtype=torch.bfloat16)
    softmax_topk(logits, 8, True), moe_sum(down, 8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (weights, ids), out = softmax_topk(logits, 8, True), moe_sum(down, 8)
    logits.copy_(_distinct_logits(64, 128, torch.bfloat16, seed=1))
    down.copy_(torch.randn_like(down))
    graph.replay()
    expected_weights, expected_ids = softmax_topk_ref(logits, 8, True)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(out.float(), down.float().view(64, 8, 2048).sum(1), rtol=1e-2, atol=1e-2)
