"""Batches, head layouts and the comparison shared by the GPU tests of the compiled
paged-attention kernels (csrc and Triton)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.kernels.paged_attention import paged_attention_ref
from tests.kernels.metadata_utils import make_paged_attention_inputs

# (query_lens, seq_lens): decode with contexts across chunk and split boundaries, chunked prefill
# after a cached prefix, and a mix.
GPU_BATCHES = [
    ([1] * 8, [1, 17, 255, 256, 257, 1000, 3000, 4100]),
    ([40, 100], [300, 100]),
    ([7, 1, 33, 1, 12], [7, 2000, 290, 2, 12]),
]
# (num_heads, num_kv_heads): MHA, GQA 4 (Llama-3-8B), 3 and 7 (padded groups), 10 (two head
# chunks in the csrc kernel), MQA.
GPU_HEADS = [(8, 8), (32, 8), (12, 4), (28, 4), (40, 4), (16, 1)]
GPU_TOLERANCE = {
    torch.float32: {"rtol": 2e-4, "atol": 2e-4},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def run_compiled(
    op: Callable[..., object], batch, num_heads, num_kv_heads, head_size, block_size, dtype, num_splits=0, **extra
):
    """Run a compiled `paged_attention` on CUDA inputs and compare it with the reference
    (`extra`: keyword arguments only the Triton op takes, e.g. longest_first=True for its
    decode_order)."""
    query_lens, seq_lens = batch
    query, kv_cache, md = make_paged_attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device="cuda"
    )
    scale = head_size**-0.5
    expected = paged_attention_ref(query, kv_cache, md, scale)
    out = torch.full_like(query, float("nan"))
    if extra.pop("longest_first", False):
        extra["decode_order"] = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    op(
        out,
        query,
        kv_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_tables,
        md.max_query_len,
        md.max_seq_len,
        scale,
        num_splits,
        **extra,
    )
    torch.testing.assert_close(out, expected, **GPU_TOLERANCE[dtype])
