"""Routing replay on the trainer's side: the experts the engine routed each position to
(`CompletionOutput.routed_experts`, SGLang's base64 `meta_info.routed_experts`, the vLLM-shaped
`routed_experts` lists) as per-layer boolean masks [num_tokens, num_experts], which a trainer's
router applies in place of its own top-k so that its forward takes the rollout's experts.

    masks = routing_masks(output.routed_experts, num_experts=config.num_experts)
    # masks[layer]: None for a dense layer, else mask[t, e] is True for the top-k experts of t
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import torch


def decode_routed_experts(encoded: str, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [num_tokens, num_layers, top_k])."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"{flat.size} expert ids are not whole rows of {num_layers} layers x top {top_k}")
    return flat.reshape(-1, num_layers, top_k)


def routing_masks(
    routed_experts: np.ndarray | torch.Tensor | Sequence, num_experts: int, device: torch.device | str = "cpu"
) -> list[torch.Tensor | None]:
    """Per decoder layer, the mask [num_tokens, num_experts] (True: routed there), or None for
    a layer without routed experts (ids -1). `routed_experts`: [num_tokens, num_layers, top_k]."""
    ids = torch.as_tensor(np.array(routed_experts, dtype=np.int64), device=device)
    if ids.ndim != 3:
        raise ValueError(f"routed experts must be [num_tokens, num_layers, top_k], got shape {list(ids.shape)}")
    if ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"expert id {int(ids.max())} is out of range for {num_experts} experts")
    masks: list[torch.Tensor | None] = []
    for layer in range(ids.shape[1]):
        layer_ids = ids[:, layer]  # [num_tokens, top_k]
        if ids.shape[0] and bool((layer_ids < 0).all()):
            masks.append(None)
            continue
        mask = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool, device=device)
        mask.scatter_(1, layer_ids.clamp(min=0), layer_ids >= 0)
        masks.append(mask)
    return masks
