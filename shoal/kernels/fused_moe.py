"""`fused_moe`: the routed experts of a mixture-of-experts layer applied to a batch of tokens,
each token through its top-k SwiGLU experts and the outputs summed with the routing weights.

For a token x with choices (e_j, w_j), j < top_k:

    out = sum_j w_j * W2[e_j] (silu(x W1[e_j]^T) * (x W3[e_j]^T))

with the experts' weights stacked as w13 [num_experts, 2 * I, hidden] (rows [0, I) are W1, the
gate; [I, 2I) are W3, the up projection) and w2 [num_experts, hidden, I]. Under tensor
parallelism I is this rank's slice and `out` a partial sum the caller all-reduces.

`expert_map` [num_global_experts] (expert parallelism) maps the router's global expert ids to
this rank's rows of w13/w2, -1 for experts on other ranks: those choices add nothing here.

`fused_moe_ref` is the pure-torch path (CPU, and anywhere the kernel is not built): experts one
after another in id order, each on the tokens that chose it, summed with index_add_, which is
Hugging Face's order of operations (so float32 matches it to the last bits or nearly). On CUDA
`fused_moe` runs the Triton kernels of shoal/kernels/triton/fused_moe.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import registered_kernel


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The router's expert ids as this rank's expert rows (-1: an expert of another rank)."""
    return topk_ids if expert_map is None else expert_map[topk_ids.long()]


def expert_entries(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each local expert that was chosen, in id order, with its entries (entry = token * top_k
    + j of topk_ids [num_tokens, top_k]) in token order."""
    ids = local_expert_ids(topk_ids, expert_map).flatten().long()  # [num_tokens * top_k]
    on_rank = (ids >= 0) & (ids < num_local_experts)
    entries = torch.nonzero(on_rank).flatten()
    order = torch.argsort(ids[entries], stable=True)  # group the entries by expert
    entries = entries[order]
    counts = torch.bincount(ids[entries], minlength=num_local_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, entries[start : start + count]
        start += count


def fused_moe_ref(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    intermediate_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """hidden_states [num_tokens, hidden], topk_weights/topk_ids [num_tokens, top_k] ->
    [num_tokens, hidden] in hidden_states' dtype (see the module docstring).
    `intermediate_quant` rounds each expert's silu(gate) * up as a quantized down projection's
    input is rounded (the block-fp8 reference, shoal/kernels/fused_moe_block_fp8.py)."""
    top_k = topk_ids.shape[1]
    intermediate2 = w13.shape[1]
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.flatten()
    for expert, chosen in expert_entries(topk_ids, expert_map, w13.shape[0]):
        tokens = chosen // top_k
        gate, up = F.linear(hidden_states[tokens], w13[expert]).split(intermediate2 // 2, dim=-1)
        activated = F.silu(gate) * up  # [count, intermediate]
        if intermediate_quant is not None:
            activated = intermediate_quant(activated)
        expert_out = F.linear(activated, w2[expert])  # [count, hidden]
        out.index_add_(0, tokens, (expert_out * weights[chosen, None]).to(out.dtype))
    return out


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels on CUDA (registered as "fused_moe"), `fused_moe_ref` elsewhere; same
    arguments and result."""
    kernel = registered_kernel("fused_moe", hidden_states)
    if kernel is None:
        return fused_moe_ref(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    return kernel(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)  # type: ignore[return-value]


_WARMED_UP: set[tuple] = set()


def warm_up_fused_moe(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_num_tokens: int, expert_map: torch.Tensor | None = None
) -> list[int]:
    """On CUDA, run the registered kernel once per launch configuration that batches of up to
    `max_num_tokens` tokens can pick, so that every Triton variant a run launches is compiled
    before the run; returns the batch sizes run (none without the kernel, or when a layer of
    the same shape was warmed up already in this process)."""
    kernel = registered_kernel("fused_moe", w13)
    if kernel is None:
        return []
    # Kernels compile per shape and dtype, not per layer: the model's other layers of this
    # shape have nothing left to compile.
    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, w13.device, top_k, max_num_tokens, expert_map is not None)
    if key in _WARMED_UP:
        return []
    _WARMED_UP.add(key)
    batches = warm_up_batches(w13, top_k, max_num_tokens, expert_map)
    for hidden_states, topk_weights, topk_ids in batches:
        kernel(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    return [hidden_states.shape[0] for hidden_states, _, _ in batches]


def warm_up_batches(
    w13: torch.Tensor, top_k: int, max_num_tokens: int, expert_map: torch.Tensor | None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(hidden_states, topk_weights, topk_ids) of one batch per launch configuration that
    batches of up to `max_num_tokens` tokens can pick (CUDA: the Triton launch tables)."""
    from shoal.kernels.triton.fused_moe_config import device_name, dtype_name, launch_table, warm_up_token_counts

    num_experts, intermediate2, hidden = w13.shape
    table = launch_table(num_experts, intermediate2 // 2, dtype_name(w13.dtype), device_name(w13.device))
    num_global_experts = num_experts if expert_map is None else expert_map.numel()
    batches = []
    for num_tokens in warm_up_token_counts(table, max_num_tokens):
        hidden_states = torch.zeros(num_tokens, hidden, dtype=w13.dtype, device=w13.device)
        # Choices spread over every expert, so that every expert's blocks are in use.
        topk_ids = torch.arange(num_tokens * top_k, device=w13.device).remainder(num_global_experts)
        topk_weights = torch.ones(num_tokens, top_k, dtype=torch.float32, device=w13.device)
        batches.append((hidden_states, topk_weights, topk_ids.view(num_tokens, top_k)))
    return batches
