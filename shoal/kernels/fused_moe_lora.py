"""`fused_moe_lora`: `fused_moe` (shoal/kernels/fused_moe.py) with each token's LoRA adapter on
the routed experts. For a token x in adapter slot s (-1: the base model, no delta) and each of its
choices (e_j, w_j):

    gate_up = W13[e_j] x + B13[s, e_j] (A13[s, e_j] x)                  (before the activation)
    a       = silu(gate_up[:I]) * gate_up[I:]
    out    += w_j * (W2[e_j] a + B2[s, e_j] (A2[s, e_j] a))             (before the weighted sum)

with the adapters' stacked slot tensors (scaling folded into B, ranks zero-padded to R):

    gate_up_a [num_slots, E, R, hidden]   gate_up_b [num_slots, E, 2I, R]
    down_a    [num_slots, E, R, I]        down_b    [num_slots, E, hidden, R]

E, I and `expert_map` are this rank's as in `fused_moe`: under tensor parallelism the deltas are
partial sums like the base's (B13's rows and A2's columns cut like W13's and W2's), so the
caller's one all-reduce sums both.

`fused_moe_lora_ref` is the pure-torch path: `fused_moe_ref`'s loop over the experts with the
batched LoRA references of shoal/kernels/lora.py on each expert's tokens. On CUDA the registered
"fused_moe_lora" (shoal/kernels/triton/fused_moe_lora.py) runs the unfused grouped GEMMs with the
per-token LoRA kernels between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import registered_kernel
from shoal.kernels.fused_moe import expert_entries, warm_up_batches
from shoal.kernels.lora import lora_expand_ref, lora_shrink_ref


def fused_moe_lora_ref(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    gate_up_a: torch.Tensor,
    gate_up_b: torch.Tensor,
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """hidden_states [num_tokens, hidden], topk_weights/topk_ids [num_tokens, top_k], token_slots
    [num_tokens] (int, -1: the base model) -> [num_tokens, hidden] (see the module docstring)."""
    top_k = topk_ids.shape[1]
    intermediate = w13.shape[1] // 2
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.flatten()
    for expert, chosen in expert_entries(topk_ids, expert_map, w13.shape[0]):
        tokens = chosen // top_k
        x, slots = hidden_states[tokens], token_slots[tokens]  # this expert's rows and their slots
        gate_up = F.linear(x, w13[expert])  # [count, 2I]
        lora_expand_ref(gate_up, lora_shrink_ref(x, gate_up_a[:, expert], slots), gate_up_b[:, expert], slots)
        gate, up = gate_up.split(intermediate, dim=-1)
        activated = F.silu(gate) * up  # [count, I]
        expert_out = F.linear(activated, w2[expert])  # [count, hidden]
        lora_expand_ref(expert_out, lora_shrink_ref(activated, down_a[:, expert], slots), down_b[:, expert], slots)
        out.index_add_(0, tokens, (expert_out * weights[chosen, None]).to(out.dtype))
    return out


def fused_moe_lora(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    gate_up_a: torch.Tensor,
    gate_up_b: torch.Tensor,
    down_a: torch.Tensor,
    down_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """The registered "fused_moe_lora" kernel on CUDA, `fused_moe_lora_ref` elsewhere; same
    arguments and result."""
    args = (hidden_states, w13, w2, topk_weights, topk_ids, expert_map, gate_up_a, gate_up_b, down_a, down_b)
    kernel = registered_kernel("fused_moe_lora", hidden_states)
    if kernel is None:
        return fused_moe_lora_ref(*args, token_slots)
    return kernel(*args, token_slots)  # type: ignore[return-value]


_WARMED_UP: set[tuple] = set()


def warm_up_fused_moe_lora(
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    max_num_tokens: int,
    expert_map: torch.Tensor | None,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> list[int]:
    """`warm_up_fused_moe` for the LoRA form (its gate_up GEMM without the fused activation is
    another kernel variant), every token in slot 0 so that every kernel runs; `lora` is
    (gate_up_a, gate_up_b, down_a, down_b). Nothing without the kernel, or for a shape warmed up
    already; returns the batch sizes run."""
    kernel = registered_kernel("fused_moe_lora", w13)
    if kernel is None:
        return []
    key = (tuple(w13.shape), tuple(w2.shape), *(tuple(t.shape) for t in lora), w13.dtype, w13.device, top_k)
    key += (max_num_tokens, expert_map is not None)
    if key in _WARMED_UP:
        return []
    _WARMED_UP.add(key)
    batches = warm_up_batches(w13, top_k, max_num_tokens, expert_map)
    for hidden_states, topk_weights, topk_ids in batches:
        slots = torch.zeros(hidden_states.shape[0], dtype=torch.int32, device=w13.device)
        kernel(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, *lora, slots)
    return [hidden_states.shape[0] for hidden_states, _, _ in batches]
