"""The device's streaming-read rate: a Triton kernel that reads a large buffer once and sums it.

A decode step only reads (weights, the KV cache), and on an H200 reading alone runs faster than
a copy (one H200: 4.62 TB/s read against 4.24 TB/s for a device-to-device copy, reads and writes
counted together; torch's `sum` reads at the copy rate), so the read rate is the ceiling a
weight-bound step meets. GPU only: the kernel needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 64 Ki elements a program in tiles of 4 Ki, 8 warps: the fastest of a sweep of tile sizes,
# tiles a program and warps on one H200.
BLOCK, TILES_PER_PROGRAM, NUM_WARPS = 4096, 16, 8


@triton.jit
def _sum_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """partial[p] = the sum of the program's TILES tiles (a result, so no load is dead code)."""
    first = tl.program_id(0).to(tl.int64) * BLOCK * TILES
    acc = tl.zeros([BLOCK], tl.float32)
    for tile in range(TILES):
        offs = first + tile * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, 0))


def stream_read(x: torch.Tensor, partials: torch.Tensor) -> None:
    """Read every element of the 1-D `x` once; `partials` holds one float32 per program."""
    _sum_kernel[(partials.numel(),)](x, partials, x.numel(), BLOCK=BLOCK, TILES=TILES_PER_PROGRAM, num_warps=NUM_WARPS)


def num_programs(num_elements: int) -> int:
    return triton.cdiv(num_elements, BLOCK * TILES_PER_PROGRAM)
