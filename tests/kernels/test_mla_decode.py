"""`mla_decode`: the reference against attention written out by hand, the absorbed form against
the expanded one, the Triton kernel under the interpreter (CPU) and on a GPU over DeepSeek's
shapes and dtypes."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.mla_decode import mla_decode, mla_decode_ref
from tests.kernels.interpreter import needs_triton, run_interpreter_check
from tests.kernels.triton_mla_decode_check import Case, check_cache_write, check_decode, make_decode_inputs


def test_reference_is_softmax_attention_over_each_requests_latents():
    case = Case((5, 1, 13), 4, 32, 8, torch.float64)
    args = make_decode_inputs(case, torch.device("cpu"))
    out = mla_decode(**{k: args[k] for k in ("query", "kv_cache", "block_tables", "seq_lens", "max_seq_len")},
                     kv_lora_rank=32, scale=args["scale"])  # fmt: skip
    latents = args["kv_cache"][0, :, :, 0]  # [num_blocks, block_size, latent]
    for i, seq_len in enumerate(case.seq_lens):
        context = latents[args["block_tables"][i].long()].flatten(0, 1)[:seq_len]  # [S, latent]
        weights = (args["query"][i] @ context.T * args["scale"]).softmax(-1)  # [H, S]
        torch.testing.assert_close(out[i], weights @ context[:, :32], rtol=0, atol=1e-12)


def test_absorbed_decode_equals_expanded_attention():
    """q_nope . (W_UK c) = (W_UK^T q_nope) . c and W_UV is linear: attending over the latents with
    the folded query, then W_UV, is attention over the up-projected keys and values."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank, seq_len = 4, 16, 8, 12, 32, 9
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=gen), torch.randn(heads, v_dim, rank, generator=gen)
    c, k_pe = torch.randn(seq_len, rank, generator=gen), torch.randn(seq_len, rope, generator=gen)
    q_nope, q_pe = torch.randn(heads, nope, generator=gen), torch.randn(heads, rope, generator=gen)
    scale = (nope + rope) ** -0.5
    keys = torch.cat((torch.einsum("hnr,sr->hsn", w_uk, c), k_pe.expand(heads, -1, -1)), dim=-1)  # [H, S, nope + rope]
    values = torch.einsum("hvr,sr->hsv", w_uv, c)  # [H, S, v]
    scores = torch.einsum("hd,hsd->hs", torch.cat((q_nope, q_pe), dim=-1), keys) * scale
    expanded = torch.einsum("hs,hsv->hv", scores.softmax(-1), values)
    cache = torch.cat((c, k_pe), dim=-1).view(1, 3, 3, 1, rank + rope)  # 3 blocks of 3 positions
    query = torch.cat((torch.einsum("hn,hnr->hr", q_nope, w_uk), q_pe), dim=-1)[None]  # [1, H, rank + rope]
    latent_out = torch.empty(1, heads, rank)
    mla_decode_ref(latent_out, query, cache, torch.tensor([[0, 1, 2]]), torch.tensor([seq_len]), seq_len, scale)
    torch.testing.assert_close(torch.einsum("hr,hvr->hv", latent_out[0], w_uv), expanded, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_mla_decode_check")


GPU_CASES = [
    # DeepSeek-V2-Lite: 16 heads, latent 512 + 64, blocks of 16; a batch of decodes, unsplit and split.
    *(Case(tuple(range(1, 4096, 61))[:64], 16, 512, 64, dtype, block_size=16) for dtype in (torch.bfloat16, torch.float16)),
    Case((4000, 17), 16, 512, 64, torch.bfloat16, block_size=16),  # two long requests: split-K
    Case((3000, 33, 1), 16, 512, 64, torch.bfloat16, block_size=16, num_splits=7),
    # DeepSeek-V3 at one GPU (128 heads, two programs of 64), at TP=8 (16) and TP=4 (32),
    # with a CUDA graph's bound past the batch.
    Case((1500, 200, 7, 1), 128, 512, 64, torch.bfloat16, block_size=16),
    Case((700,) * 8, 16, 512, 64, torch.bfloat16, block_size=16, max_seq_len=8192),
    Case((900, 40), 32, 512, 64, torch.bfloat16, block_size=16),  # TP=4: 32 heads a program
    Case((300, 5), 16, 512, 64, torch.float32, block_size=16),  # float32: "ieee" dots
    Case((5, 1, 13), 4, 32, 8, torch.bfloat16),  # the tiny test model's shape
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_kernel_on_gpu(case):
    from shoal.kernels.triton.mla_decode import triton_mla_decode

    assert check_decode(triton_mla_decode, case, torch.device("cuda")) == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_cache_write_on_gpu(dtype):
    from shoal.kernels.triton.mla_decode import triton_concat_and_cache_mla

    assert check_cache_write(triton_concat_and_cache_mla, dtype, torch.device("cuda")) == []


@pytest.mark.gpu
def test_the_wrapper_dispatches_to_triton_on_gpu():
    from shoal.kernels.dispatch import registered_kernel
    from shoal.kernels.triton.mla_decode import triton_mla_decode

    assert registered_kernel("mla_decode", torch.zeros(1, device="cuda")) is triton_mla_decode
