"""Sampling from softmax(logits / temperature) in one pass over the vocabulary: the Gumbel-max
trick (Gumbel, 1954; Maddison et al., 2014, "A* Sampling"): argmax(logits / T + G) with G
drawn i.i.d. from Gumbel(0, 1) is distributed as softmax(logits / T).

The sampler's general path materializes temperature-scaled logits, a softmax, exponential noise
and a quotient, each a full [rows, vocab] float32 tensor; the compiled op reads the logits once
and draws its noise in registers from a counter-based generator keyed by `seed`. It serves
batches without top-k, top-p, min-p or per-request seeds (those keep the general path), on CUDA
unless `SHOAL_FUSED_SAMPLING=0`.
"""

from __future__ import annotations

import torch

from shoal import envs
from shoal.kernels.dispatch import registered_kernel


def gumbel_sample_ref(out: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> None:
    """out [rows] int64 = argmax(logits / temperature[:, None] + Gumbel noise), logits [rows, vocab]."""
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20, max=1 - 1e-7)
    gumbel = -torch.log(-torch.log(uniform))
    out.copy_((logits.float() / temperature[:, None] + gumbel).argmax(dim=-1))


def fused_sampling_kernel(logits: torch.Tensor):
    """The compiled op for these logits, when fused sampling is on and one is registered."""
    return registered_kernel("gumbel_sample", logits) if envs.SHOAL_FUSED_SAMPLING else None


def gumbel_sample(out: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> None:
    op = fused_sampling_kernel(logits)
    if op is None:
        gumbel_sample_ref(out, logits, temperature, seed)
    else:
        op(out, logits, temperature, seed)
