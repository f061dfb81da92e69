"""Inputs of `fused_moe_lora` for its tests (shared by the CPU tests, the interpreter check and
the GPU test), and the formula it computes, entry by entry in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_inputs(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, num_slots: int, rank: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Random experts and adapters; every third token is the base model's (slot -1)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    topk_weights, topk_ids = torch.rand(num_tokens, num_experts, generator=g).topk(top_k, dim=-1)
    slots = torch.arange(num_tokens) % num_slots
    slots[::3] = -1
    return {
        "hidden_states": rand(num_tokens, hidden),
        "w13": rand(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5),
        "w2": rand(num_experts, hidden, intermediate, scale=intermediate**-0.5),
        "topk_weights": topk_weights.to(device),
        "topk_ids": topk_ids.to(device),
        "expert_map": None,
        "gate_up_a": rand(num_slots, num_experts, rank, hidden, scale=hidden**-0.5),
        "gate_up_b": rand(num_slots, num_experts, 2 * intermediate, rank, scale=0.5),
        "down_a": rand(num_slots, num_experts, rank, intermediate, scale=intermediate**-0.5),
        "down_b": rand(num_slots, num_experts, hidden, rank, scale=0.5),
        "token_slots": slots.to(torch.int32).to(device),
    }


def formula(inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """out[t] = sum_j w_j (W2 a + B2 A2 a), a = silu_and_mul(W13 x + B13 A13 x), expert by expert
    in float64 (`expert_map`: global id → local row, -1 another rank's)."""
    d = {k: (v.double().cpu() if v is not None and v.is_floating_point() else v) for k, v in inputs.items()}
    x, topk_ids, expert_map = d["hidden_states"], d["topk_ids"].cpu(), d["expert_map"]
    out = torch.zeros_like(x)
    intermediate = d["w13"].shape[1] // 2
    for t in range(x.shape[0]):
        s = int(d["token_slots"][t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) if expert_map is None else int(expert_map.cpu()[topk_ids[t, j]])
            if e < 0:
                continue
            gate_up = d["w13"][e] @ x[t]
            if s >= 0:
                gate_up = gate_up + d["gate_up_b"][s, e] @ (d["gate_up_a"][s, e] @ x[t])
            a = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            y = d["w2"][e] @ a
            if s >= 0:
                y = y + d["down_b"][s, e] @ (d["down_a"][s, e] @ a)
            out[t] += float(d["topk_weights"][t, j]) * y
    return out
