from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.attention_cases import GPU_BATCHES, GPU_HEADS, run_compiled
from tests.kernels.interpreter import needs_triton, run_interpreter_check


@needs_triton
def test_triton_paged_attention_under_the_interpreter():
    """The Triton kernels on CPU tensors under TRITON_INTERPRET=1, in a fresh process (the
    interpreter is picked when the kernels are decorated)."""
    run_interpreter_check("tests.kernels.triton_interpreter_check")


@needs_triton
@pytest.mark.parametrize(
    "batch, max_seq_len, splits",
    [
        (256, 4096, 1),  # 2,048 programs fill 132 SMs: no split, no reduce kernel
        (129, 4096, 1),  # 1,032 programs: still at least 4 per SM
        (64, 4096, 5),  # 512 programs: split towards 16 per SM (2,112)
        (1, 4096, 16),  # one request: as many splits as 256-token pieces allow
        (1, 300, 2),
        (8, 200, 1),  # a context too short to split
    ],
)
def test_decode_splits_only_grids_too_small_for_the_gpu(batch: int, max_seq_len: int, splits: int) -> None:
    from shoal.kernels.triton.paged_attention import choose_num_splits

    # 8 KV heads per request; the CPU stands in for a 132-SM H200.
    assert choose_num_splits(batch * 8, max_seq_len, torch.device("cpu")) == splits


@needs_triton
def test_decode_reduce_has_one_width_up_to_16_splits() -> None:
    """The reduce kernel's width is a compile-time constant: every split count a 4,096-token
    context can have maps to one, so a mixed batch with a few short decodes compiles nothing new."""
    from shoal.kernels.triton.paged_attention import _reduce_width

    assert {_reduce_width(n) for n in range(2, 17)} == {16}
    assert _reduce_width(40) == 64


def _triton_op():
    from shoal.kernels.triton.paged_attention import triton_paged_attention

    return triton_paged_attention


# Every head layout in bf16, one in the other dtypes: each (layout, dtype) is a fresh Triton
# compile, which dominates the GPU run's time.
HEADS_AND_DTYPES = [(*heads, torch.bfloat16) for heads in GPU_HEADS] + [
    (32, 8, torch.float32),
    (32, 8, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", HEADS_AND_DTYPES)
def test_triton_paged_attention(batch, num_heads, num_kv_heads, dtype):
    run_compiled(_triton_op(), batch, num_heads, num_kv_heads, 128, 16, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 80, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_triton_paged_attention_head_and_block_sizes(head_size, block_size):
    run_compiled(_triton_op(), GPU_BATCHES[2], 8, 2, head_size, block_size, torch.bfloat16)
    run_compiled(_triton_op(), GPU_BATCHES[0], 8, 2, head_size, block_size, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])
def test_triton_decode_forced_splits(num_splits):
    run_compiled(_triton_op(), GPU_BATCHES[0], 32, 8, 128, 16, torch.float32, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_fastest", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_longest_first(heads_fastest, num_splits, monkeypatch):
    """The decode kernel taking the requests longest context first (as the engine passes them),
    with its programs numbered either way, writes every request's own row (an unsplit grid
    follows the order; a split one keeps batch order)."""
    from shoal.kernels.triton import paged_attention as tpa

    monkeypatch.setattr(tpa, "DECODE_TUNING", dataclasses.replace(tpa.DECODE_TUNING, heads_fastest=heads_fastest))
    for batch in (GPU_BATCHES[0], GPU_BATCHES[2]):  # all decodes; decodes next to prefills
        run_compiled(_triton_op(), batch, 32, 8, 128, 16, torch.bfloat16, num_splits, longest_first=True)


@pytest.mark.gpu
def test_triton_prefill_with_long_prefix():
    """Prefix-cache hit: a few new tokens after thousands of cached ones, next to fresh prompts."""
    run_compiled(_triton_op(), ([3, 64, 1, 200], [3000, 64, 513, 1200]), 32, 8, 128, 16, torch.bfloat16)
