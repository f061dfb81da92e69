"""`gumbel_sample` as one Triton kernel (semantics and reference: shoal/kernels/gumbel_sample.py).

One program per row walks the vocabulary in BLOCK-wide tiles, adds Gumbel noise drawn from
Philox (`tl.rand`, keyed by the step's seed and the element's index) to logits / temperature,
and keeps the running maximum and its index: the logits are read once, nothing is written but
the sampled id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_sample_kernel(out_ptr, logits_ptr, temperature_ptr, seed, vocab_size, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_temperature = 1.0 / tl.load(temperature_ptr + row)
    best_value = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab_size
        logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=valid, other=float("-inf"))
        uniform = tl.rand(seed, row * vocab_size + offs)
        uniform = tl.minimum(tl.maximum(uniform, 1e-20), 1.0 - 1e-7)
        value = logits.to(tl.float32) * inv_temperature - tl.log(-tl.log(uniform))
        value = tl.where(valid, value, float("-inf"))
        better = value > best_value
        best_value = tl.where(better, value, best_value)
        best_index = tl.where(better, offs, best_index)
    # The tile's lanes hold per-lane maxima; the row's is the best of them.
    row_best = tl.max(best_value, 0)
    index = tl.min(tl.where(best_value == row_best, best_index, vocab_size), 0)
    tl.store(out_ptr + row, index.to(tl.int64))


def triton_gumbel_sample(out: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> None:
    """out [rows] int64; logits [rows, vocab] (rows contiguous); temperature [rows] float32."""
    rows, vocab_size = logits.shape
    if rows == 0:
        return
    _gumbel_sample_kernel[(rows,)](
        out, logits, temperature, seed, vocab_size, logits.stride(0), BLOCK=1024, num_warps=4
    )
