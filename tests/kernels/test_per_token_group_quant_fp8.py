"""`per_token_group_quant_fp8`: the reference against its formula (groups, a short last group,
all-zero groups, column-major scales, leading dimensions), and the Triton kernel against the
reference on a GPU over shapes and dtypes. (The kernel under the interpreter:
tests/kernels/test_w8a8_block_fp8_matmul.py runs the block-fp8 kernels' check.)"""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.dispatch import has_op
from shoal.kernels.per_token_group_quant_fp8 import (
    dequantize_per_token_group,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX


def test_reference_is_the_formula():
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(0))
    x[0, 1, 16:32] = 0
    out, scales = per_token_group_quant_fp8(x, 16)  # CPU: the reference
    assert out.dtype == FP8_DTYPE and out.shape == x.shape and scales.shape == (2, 3, 3)
    for g, cols in enumerate((slice(0, 16), slice(16, 32), slice(32, 40))):  # the last group is short
        amax = x[..., cols].abs().amax(-1)
        torch.testing.assert_close(scales[..., g], amax.clamp(min=1e-10) / FP8_MAX, rtol=0, atol=0)
        expected = (x[..., cols] / scales[..., g : g + 1]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        assert torch.equal(out[..., cols].float(), expected.float())
    assert (scales > 0).all() and (out[0, 1, 16:32].float() == 0).all()
    # Every group's largest value maps to +-448, and dequantization is within e4m3's rounding.
    assert out.float().abs().amax(-1).eq(FP8_MAX).all()
    deq = dequantize_per_token_group(out, scales, 16)
    # Half a step of 2^-3 relative for normal e4m3 values, half the subnormal step (2^-9 of the
    # group's scale) for the group's smallest.
    step = scales.repeat_interleave(16, dim=-1)[..., :40] * 2**-10
    assert ((deq - x).abs() <= x.abs() * 2**-4 + step + 1e-12).all()


def test_column_major_scales_hold_the_same_values():
    x = torch.randn(5, 64)
    out, scales = per_token_group_quant_fp8_ref(x, 32, column_major_scales=True)
    row_out, row_scales = per_token_group_quant_fp8_ref(x, 32)
    assert scales.shape == (5, 2) and scales.stride() == (1, 5)
    assert torch.equal(scales, row_scales) and torch.equal(out.float(), row_out.float())
    with pytest.raises(ValueError, match="2-D input"):
        per_token_group_quant_fp8_ref(torch.randn(2, 5, 64), 32, column_major_scales=True)
    with pytest.raises(ValueError, match="group_size must be positive"):
        per_token_group_quant_fp8_ref(x, 0)


def test_empty_batch():
    out, scales = per_token_group_quant_fp8(torch.randn(0, 256), 128)
    assert out.shape == (0, 256) and scales.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4096])
@pytest.mark.parametrize(("hidden", "group_size"), [(7168, 128), (2048, 128), (576, 128), (512, 64)])
@pytest.mark.parametrize("column_major", [False, True])
def test_triton_matches_reference_on_gpu(dtype, num_tokens, hidden, group_size, column_major):
    """Same scales; the same e4m3 values (both divide in IEEE float32 and round to nearest even)."""
    x = torch.randn(num_tokens, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype) * 4
    x[0, :group_size] = 0
    assert has_op("per_token_group_quant_fp8", x)
    out, scales = per_token_group_quant_fp8(x, group_size, column_major_scales=column_major)
    expected, expected_scales = per_token_group_quant_fp8_ref(x, group_size, column_major_scales=column_major)
    assert scales.stride() == expected_scales.stride()
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
    assert torch.equal(out.float(), expected.float())


@pytest.mark.gpu
def test_triton_quant_in_a_cuda_graph():
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    per_token_group_quant_fp8(x, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, scales = per_token_group_quant_fp8(x, 128)
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    expected, expected_scales = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(out.float(), expected.float())
    torch.testing.assert_close(scales, expected_scales, rtol=1e-6, atol=0)
