"""`fused_moe_lora` on the GPU (semantics and reference: shoal/kernels/fused_moe_lora.py): the
fused-MoE grouped GEMMs of shoal/kernels/triton/fused_moe.py, unfused where the adapters' deltas
go in, with the per-token LoRA kernels of shoal/kernels/triton/lora.py between them.

Each (token, choice) entry is one row, and its "slot" for the LoRA kernels is the pair
(adapter slot, local expert) flattened to `slot * E + expert` (-1 for a token of the base model or
another rank's expert), so the slot tensors viewed as [num_slots * E, ...] are ordinary LoRA slot
tensors:

1. x_rows = x[entry // top_k]; gate_up = the grouped GEMM of x_rows with w13 (no activation);
   gate_up += B13 (A13 x_rows) per entry.
2. activated = silu_and_mul(gate_up).
3. down = the grouped GEMM of activated with w2, times the routing weight;
   down += B2 (w * (A2 activated)) per entry (the weight on the small [entries, R] product).
4. The top-k sum.

Nothing reads back to the host, so decode steps are captured in CUDA graphs; the base model's
tokens return at once in the LoRA kernels. The fused gate_up-with-activation kernel is kept for
steps whose adapters have no experts' deltas (the layer calls plain `fused_moe` then).
"""

from __future__ import annotations

import torch

from shoal.kernels.fused_moe import local_expert_ids
from shoal.kernels.moe_align_block_size import moe_align_block_size
from shoal.kernels.silu_and_mul import silu_and_mul
from shoal.kernels.triton.fused_moe import invoke_moe_gemm
from shoal.kernels.triton.fused_moe_config import MoELaunch, moe_launch_for
from shoal.kernels.triton.lora import triton_lora_expand, triton_lora_shrink
from shoal.kernels.triton.moe_sum import moe_sum


def entry_slots(token_slots: torch.Tensor, local_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """[num_entries] int32: slot * E + local expert of each entry, -1 where the token has no
    adapter or the expert is another rank's."""
    num_tokens, top_k = local_ids.shape
    slots = token_slots[:num_tokens].long()[:, None].expand(-1, top_k)
    ids = local_ids.long()
    used = (slots >= 0) & (ids >= 0) & (ids < num_local_experts)
    return torch.where(used, slots * num_local_experts + ids, -1).reshape(-1).to(torch.int32)


def triton_fused_moe_lora(
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
    launch: MoELaunch | None = None,
) -> torch.Tensor:
    """The registered "fused_moe_lora": `fused_moe_lora_ref`'s arguments and result. `launch`
    overrides the tuned configuration (tests)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, intermediate2, hidden = w13.shape
    if launch is None:
        launch = moe_launch_for(num_experts, intermediate2 // 2, hidden_states.dtype, hidden_states.device, num_tokens)
    ids = local_expert_ids(topk_ids, expert_map)
    routing = moe_align_block_size(ids, num_experts, launch.block_size_m)
    weights = topk_weights.to(torch.float32).reshape(-1)  # [num_entries], entry = token * top_k + j
    slots = entry_slots(token_slots, ids, num_experts)
    num_entries = num_tokens * top_k
    device, dtype = hidden_states.device, hidden_states.dtype
    # Choices of another rank's experts are never written: their rows must read as zero.
    alloc = torch.empty if expert_map is None else torch.zeros
    x_rows = hidden_states[:, None].expand(-1, top_k, -1).reshape(num_entries, hidden)  # row per entry
    gate_up = alloc(num_entries, intermediate2, device=device, dtype=dtype)
    invoke_moe_gemm(x_rows, w13, gate_up, weights, routing, False, launch.block_size_m, launch.gate_up)
    h = triton_lora_shrink(x_rows, gate_up_a.flatten(0, 1), slots)  # [num_entries, R]
    triton_lora_expand(gate_up, h, gate_up_b.flatten(0, 1), slots)
    activated = torch.empty(num_entries, intermediate2 // 2, device=device, dtype=dtype)
    silu_and_mul(activated, gate_up)
    down = alloc(num_entries, hidden, device=device, dtype=dtype)
    invoke_moe_gemm(activated, w2, down, weights, routing, True, launch.block_size_m, launch.down)
    h = triton_lora_shrink(activated, down_a.flatten(0, 1), slots) * weights[:, None]
    triton_lora_expand(down, h, down_b.flatten(0, 1), slots)
    return moe_sum(down, top_k)  # [num_tokens, hidden]
