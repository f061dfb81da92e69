"""`softmax_topk`: the routing of Mixtral and Qwen2/Qwen3-MoE in one step (the rule itself is
shoal/layers/moe/routing.py's):

    scores  = softmax(router_logits) in float32
    ids     = the top_k experts by score
    weights = scores[ids], divided by their sum with `renormalize`

On CUDA one Triton program per token does all of it (shoal/kernels/triton/softmax_topk.py):
torch's softmax, topk (a radix select and a sort), gather and sum are five launches and about
30 us a layer at a decode batch of 256, more than the router's GEMM. Experts of equal score are
taken lowest index first there; the reference leaves the order of ties to torch.topk.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import registered_kernel


def softmax_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (weights float32 [num_tokens, top_k], ids int64)."""
    scores = router_logits.float().softmax(dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered "softmax_topk" kernel on CUDA, the reference elsewhere."""
    kernel = registered_kernel("softmax_topk", router_logits)
    if kernel is None:
        return softmax_topk_ref(router_logits, top_k, renormalize)
    return kernel(router_logits, top_k, renormalize)  # type: ignore[return-value]
