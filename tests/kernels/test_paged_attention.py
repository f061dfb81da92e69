from __future__ import annotations

import pytest
import torch

from shoal.kernels import paged_attention as paged_attention_module
from shoal.kernels.paged_attention import paged_attention, paged_attention_ref, plan_paged_attention
from shoal.kernels.reshape_and_cache import reshape_and_cache_ref
from tests.kernels.attention_cases import GPU_BATCHES, GPU_HEADS, GPU_TOLERANCE, run_compiled
from tests.kernels.csrc_utils import DTYPES as CSRC_DTYPES
from tests.kernels.csrc_utils import csrc_op
from tests.kernels.metadata_utils import (
    allocate_block_tables,
    make_attention_metadata,
    make_paged_attention_inputs,
    new_keys_and_values,
)

# (query_lens, seq_lens): pure prefill, pure decode, chunked prefill, and a mix of all three.
BATCHES = [
    ([5], [5]),
    ([1, 1, 1], [9, 1, 30]),
    ([4, 3], [10, 3]),
    ([7, 1, 3, 1, 12], [7, 20, 19, 2, 12]),
]


def _dense_attention(q, k, v, context_len, scale):
    """q [ql, nh, hd], k, v [S, nkv, hd], in float64 with an explicit causal mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= (context_len + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double())


def _run(batch, num_heads, num_kv_heads, head_size, block_size, dtype, plan_in_metadata=False):
    query_lens, seq_lens = batch
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    tables = allocate_block_tables(seq_lens, block_size, num_blocks, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    keys = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype) for s in seq_lens]
    # Write every request's whole context: earlier steps' tokens and this step's.
    full = make_attention_metadata(seq_lens, seq_lens, tables, block_size)
    reshape_and_cache_ref(torch.cat(keys), torch.cat(values), kv_cache, full.slot_mapping)
    md = make_attention_metadata(query_lens, seq_lens, tables, block_size)
    if plan_in_metadata:
        md.backend_state = plan_paged_attention(md, block_size)
    query = torch.randn(md.num_tokens, num_heads, head_size, generator=gen).to(dtype)
    scale = head_size**-0.5
    out = paged_attention(query, kv_cache, md, scale)
    starts = md.query_start_loc.tolist()
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        expected = _dense_attention(query[starts[i] : starts[i + 1]], keys[i], values[i], sl - ql, scale)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_float32(batch, num_heads, num_kv_heads, block_size):
    _run(batch, num_heads, num_kv_heads, 32, block_size, torch.float32)


@pytest.mark.parametrize("batch", BATCHES)
def test_paged_attention_bfloat16(batch):
    _run(batch, 8, 2, 64, 16, torch.bfloat16)


def test_paged_attention_with_precomputed_plan():
    _run(BATCHES[-1], 4, 2, 16, 4, torch.float32, plan_in_metadata=True)


def test_padding_rows_are_zero():
    md = make_attention_metadata([2, 1], [2, 5], [[0], [1, 2]], 4)
    query = torch.randn(4, 2, 8)  # one padding row past the batch's 3 tokens
    md.num_tokens = 3
    out = paged_attention_ref(query, torch.randn(2, 3, 4, 2, 8), md, 1.0)
    assert torch.count_nonzero(out[3]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_values_leave_the_cpu_path_unchanged(dtype):
    """The CPU reference reads the cache alone: passing this step's keys and values changes no bit."""
    query, kv_cache, md = make_paged_attention_inputs([6, 6, 1, 3], [6, 6, 9, 10], 4, 2, 16, 4, dtype)
    key, value = new_keys_and_values(kv_cache, md)
    assert torch.equal(
        paged_attention(query, kv_cache, md, 0.25, key, value), paged_attention(query, kv_cache, md, 0.25)
    )


# --- the compiled kernels against the reference (GPU) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GPU_HEADS)
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_paged_attention_csrc(batch, num_heads, num_kv_heads, dtype):
    run_compiled(csrc_op("paged_attention"), batch, num_heads, num_kv_heads, 128, 16, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_csrc_head_and_block_sizes(head_size, block_size):
    run_compiled(csrc_op("paged_attention"), GPU_BATCHES[2], 8, 2, head_size, block_size, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_paged_attention_csrc_forced_splits(num_splits):
    """Split-K with any split count (clamped to the chunk count) agrees with the reference."""
    run_compiled(csrc_op("paged_attention"), GPU_BATCHES[0], 32, 8, 128, 16, torch.float32, num_splits)
    run_compiled(csrc_op("paged_attention"), GPU_BATCHES[2], 32, 8, 128, 16, torch.bfloat16, num_splits)


@pytest.mark.gpu
def test_paged_attention_csrc_zeroes_padding_rows():
    query, kv_cache, md = make_paged_attention_inputs([1, 1], [5, 700], 8, 2, 128, 16, torch.bfloat16, device="cuda")
    padded = torch.cat([query, torch.randn_like(query[:3])])  # 3 rows past the batch
    for num_splits in (1, 3):
        out = torch.full_like(padded, float("nan"))
        csrc_op("paged_attention")(
            out, padded, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, 1, 700, 0.1, num_splits
        )
        assert torch.count_nonzero(out[2:]) == 0
        torch.testing.assert_close(
            out[:2], paged_attention_ref(query, kv_cache, md, 0.1), **GPU_TOLERANCE[torch.bfloat16]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("decode_kernel", ["csrc", "triton"])
@pytest.mark.parametrize("batch", [GPU_BATCHES[0], GPU_BATCHES[2]])
def test_paged_attention_wrapper_on_gpu(monkeypatch, decode_kernel, batch):
    """The public wrapper picks a compiled kernel on CUDA and pads like the reference."""
    monkeypatch.setattr(paged_attention_module, "DECODE_KERNEL", decode_kernel)
    query, kv_cache, md = make_paged_attention_inputs(*batch, 32, 8, 128, 16, torch.bfloat16, device="cuda")
    assert paged_attention_module._attention_kernel(query, md) is not None
    padded = torch.cat([query, torch.randn_like(query[:2])])
    out = paged_attention(padded, kv_cache, md, 128**-0.5)
    torch.testing.assert_close(
        out[: md.num_tokens], paged_attention_ref(query, kv_cache, md, 128**-0.5), **GPU_TOLERANCE[torch.bfloat16]
    )
    assert torch.count_nonzero(out[md.num_tokens :]) == 0
