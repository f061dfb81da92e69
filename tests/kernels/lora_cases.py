"""What the LoRA kernels' tests share: random inputs, and the plain per-token loop that defines
the shrink and the expand."""

from __future__ import annotations

import torch

# (num_tokens, in_size, out_size, num_slots, rank, dtype): ranks not powers of two, inputs and
# outputs past one block, a single token.
CASES = [
    (7, 64, 96, 3, 24, torch.float32),
    (5, 300, 520, 2, 48, torch.float16),
    (1, 40, 40, 4, 8, torch.float32),
    (12, 128, 256, 5, 64, torch.bfloat16),
]
# Slots of several tokens a tile, of more than one 64-token tile, and an input past one K split
# of the segment kernels.
SEGMENT_CASES = [(70, 300, 130, 3, 16, torch.float32), (260, 64, 80, 3, 16, torch.float16)]


def make_inputs(num_tokens, in_size, out_size, num_slots, rank, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + in_size)
    x = torch.randn(num_tokens, in_size, generator=gen).to(dtype)
    lora_a = (torch.randn(num_slots, rank, in_size, generator=gen) * 0.1).to(dtype)
    lora_b = (torch.randn(num_slots, out_size, rank, generator=gen) * 0.1).to(dtype)
    y = torch.randn(num_tokens, out_size, generator=gen).to(dtype)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    return [t.to(device) for t in (x, lora_a, lora_b, y, slots)]


def per_token_loop(x, lora_a, lora_b, y, slots):
    """y + B[s] A[s] x for each token with a slot, one token at a time (float32)."""
    expected = y.float().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[t] += lora_b[slot].float() @ (lora_a[slot].float() @ x[t].float())
    return expected
