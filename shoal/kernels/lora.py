"""Batched LoRA for a batch that mixes adapters and the base model (the SGMV / BGMV idea of
Punica and S-LoRA): one shrink and one expand per projection, each token using the adapter in
its slot.

    shrink:  h[t] = A[slots[t]] x[t]          A [num_slots, rank, in]   -> h [num_tokens, rank]
    expand:  y[t] += B[slots[t]] h[t]         B [num_slots, out, rank]  (y [num_tokens, out])

`slots[t] = -1` is the base model: h[t] = 0 and y[t] unchanged. Ranks below the slot's `rank`
are zero-padded in A and B, so the padding adds nothing. Shapes depend only on the batch, never
on which adapters it holds, so a decode step replays in a CUDA graph with `slots` in a static
buffer. The references below are static-shape too: every slot's product, masked per token.

A long eager step (prefill chunks) takes the grouped form instead: the step's tokens grouped by
slot on the host once (`groups`: each slot with its rows), then two GEMMs per adapter present,
as S-LoRA's prefill does: the per-token kernels would read each adapter's A and B once per token.

On CUDA the shrink and expand take the step's tokens sorted by slot (`LoRASegments`, made on the
host from the slot map by `sort_tokens_by_slot`): the segment kernels
(shoal/kernels/triton/lora_segments.py) load each piece of an adapter once for a tile of its
tokens. The per-token kernels (shoal/kernels/triton/lora.py) serve the MoE experts' entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.kernels.dispatch import registered_kernel


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], lora_a [S, R, in], slots [T] (int, -1: none) -> h [T, R] in float32."""
    num_slots, rank, _ = lora_a.shape
    h_all = (x.float() @ lora_a.float().reshape(num_slots * rank, -1).T).view(-1, num_slots, rank)  # [T, S, R]
    index = slots.long().clamp(min=0)[:, None, None].expand(-1, 1, rank)
    h = h_all.gather(1, index).squeeze(1)  # [T, R]
    return h * (slots >= 0)[:, None]


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += B[slots[t]] h[t] for tokens with a slot; lora_b [S, out, R]; returns y."""
    num_slots = lora_b.shape[0]
    one_hot = slots.long()[:, None] == torch.arange(num_slots, device=slots.device)  # [T, S]
    h_by_slot = h.float()[:, None, :] * one_hot[:, :, None]  # [T, S, R]: zero outside its slot
    delta = torch.einsum("tsr,sor->to", h_by_slot, lora_b.float())
    y += delta.to(y.dtype)
    return y


@dataclass
class LoRASegments:
    """A step's tokens sorted by slot: `sorted_tokens` [>= T] the token indices, each slot's
    tokens together in token order; `starts` and `counts` [num_slots] where each slot's tokens
    begin in it and how many there are. The base model's tokens are in no segment."""

    starts: torch.Tensor  # int32
    counts: torch.Tensor  # int32
    sorted_tokens: torch.Tensor  # int32

    @classmethod
    def of(cls, packed: torch.Tensor, num_slots: int) -> LoRASegments:
        """Views of a `sort_tokens_by_slot` array, or of a buffer with room for the largest step
        (the views stay put from step to step, as a CUDA graph needs)."""
        return cls(packed[:num_slots], packed[num_slots : 2 * num_slots], packed[2 * num_slots :])


def sort_tokens_by_slot(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """[starts | counts | sorted tokens] int32 for token_slots [T] (-1: the base model), in one
    array for one copy to the device (`LoRASegments.of` views it)."""
    order = np.argsort(token_slots, kind="stable")  # the base model's tokens (-1) first
    counts = np.bincount(token_slots[token_slots >= 0], minlength=num_slots)[:num_slots]
    starts = np.count_nonzero(token_slots < 0) + np.cumsum(counts) - counts
    return np.concatenate([starts, counts, order]).astype(np.int32)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """The registered "lora_shrink_segments" kernel on CUDA, the reference elsewhere."""
    kernel = registered_kernel("lora_shrink_segments", x)
    if kernel is None:
        return lora_shrink_ref(x, lora_a, slots)
    return kernel(x, lora_a, segments)  # type: ignore[return-value]


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """The registered "lora_expand_segments" kernel on CUDA, the reference elsewhere."""
    kernel = registered_kernel("lora_expand_segments", y)
    if kernel is None:
        return lora_expand_ref(y, h, lora_b, slots)
    return kernel(y, h, lora_b, segments)  # type: ignore[return-value]


def lora_shrink_grouped(x: torch.Tensor, lora_a: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """`lora_shrink` for tokens grouped by slot (`groups`: slot, its rows); h [T, R] in x's dtype."""
    h = x.new_zeros(x.shape[0], lora_a.shape[1])
    for slot, rows in groups:
        h.index_copy_(0, rows, x.index_select(0, rows) @ lora_a[slot].to(x.dtype).T)
    return h


def lora_expand_grouped(
    y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, groups: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """`lora_expand` for tokens grouped by slot; y updated in place and returned."""
    for slot, rows in groups:
        y.index_add_(0, rows, (h.index_select(0, rows).to(lora_b.dtype) @ lora_b[slot].T).to(y.dtype))
    return y
