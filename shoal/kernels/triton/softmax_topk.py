"""`softmax_topk` on the GPU (semantics and reference: shoal/kernels/softmax_topk.py): one
program per token loads its row of logits, takes the softmax in float32 and picks the top k by
k arg-max passes over the row held in registers (k is 2 to 8 and a row at most a few hundred
experts: cheaper than any sort), then renormalizes.

The number of tokens only sizes the grid (and is not specialized on), so a decode step's launch
can be captured in a CUDA graph and a new batch size compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_E and BLOCK_K: the experts and TOP_K rounded up to powers of two (the padding
    experts score below every real one, the padding choices weigh 0 and are not stored)."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    in_row = experts < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=in_row, other=float("-inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, axis=0))
    scores = tl.where(in_row, exp / tl.sum(exp, axis=0), -1.0)  # padding below every score
    choices = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    chosen_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(scores, axis=0)  # the lowest index among equal scores
        chosen_ids = tl.where(choices == j, best, chosen_ids)
        chosen_weights = tl.where(choices == j, tl.max(scores, axis=0), chosen_weights)
        scores = tl.where(experts == best, -1.0, scores)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + choices, chosen_weights, mask=choices < TOP_K)
    tl.store(ids_ptr + token * TOP_K + choices, chosen_ids, mask=choices < TOP_K)


def triton_softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered "softmax_topk": `softmax_topk_ref`'s arguments and results."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    _softmax_topk_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if num_experts <= 256 else 4,
    )  # fmt: skip
    return weights, ids
