from __future__ import annotations

import pytest
import torch

from shoal.kernels.cutlass_scaled_mm import cutlass_scaled_mm, cutlass_scaled_mm_ref
from tests.kernels.csrc_utils import csrc_op

FP8 = torch.float8_e4m3fn


def _operands(m: int, n: int, k: int, a_per_token: bool, b_per_channel: bool, device: str = "cpu"):
    """a [M, K] row-major, b [K, N] column-major (a transposed [N, K] weight), positive scales."""
    gen = torch.Generator().manual_seed(m * 131 + n * 7 + k)
    a = torch.randn(m, k, generator=gen).to(FP8)
    b = torch.randn(n, k, generator=gen).to(FP8).t()
    a_scale = torch.rand(m if a_per_token else 1, generator=gen) + 0.5
    b_scale = torch.rand(n if b_per_channel else 1, generator=gen) + 0.5
    return (t.to(device) for t in (a, b, a_scale, b_scale))


@pytest.mark.parametrize("a_per_token,b_per_channel", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_is_the_dequantized_product(a_per_token, b_per_channel, with_bias):
    a, b, a_scale, b_scale = _operands(5, 24, 32, a_per_token, b_per_channel)
    bias = torch.randn(24).to(torch.bfloat16) if with_bias else None
    out = cutlass_scaled_mm(a, b, a_scale, b_scale, torch.bfloat16, bias)
    dequant_a = a.double() * a_scale.double().reshape(-1, 1)  # [M, K] scaled per row
    dequant_b = b.double() * b_scale.double().reshape(1, -1)  # [K, N] scaled per column
    expected = dequant_a @ dequant_b + (bias.double() if with_bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 24)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_reference_accepts_column_scale_shapes():
    a, b, a_scale, b_scale = _operands(3, 16, 16, True, True)
    flat = cutlass_scaled_mm_ref(a, b, a_scale, b_scale, torch.float16)
    shaped = cutlass_scaled_mm_ref(a, b, a_scale.reshape(3, 1), b_scale.reshape(1, 16), torch.float16)
    assert torch.equal(flat, shaped)


# --- the compiled op against the reference (GPU) ---------------------------------------------------

# (a scale, b scale, bias, out dtype): every scale kind, with and without bias, both out dtypes.
EPILOGUES = [
    (False, False, False, torch.bfloat16),
    (True, True, True, torch.bfloat16),
    (True, False, False, torch.float16),
    (False, True, True, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 65, 256, 257, 1024])  # every tile configuration and its edges
@pytest.mark.parametrize("n,k", [(64, 256), (1024, 512), (3072, 2048)])
@pytest.mark.parametrize("a_per_token,b_per_channel,with_bias,out_dtype", EPILOGUES)
def test_cutlass_scaled_mm_csrc_matches_reference(m, n, k, a_per_token, b_per_channel, with_bias, out_dtype):
    a, b, a_scale, b_scale = _operands(m, n, k, a_per_token, b_per_channel, "cuda")
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    expected = cutlass_scaled_mm_ref(a, b, a_scale, b_scale, out_dtype, bias)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    csrc_op("cutlass_scaled_mm")(out, a, b, a_scale, b_scale, bias)
    # Rounding of the 16-bit output dominates; fast fp8 accumulation adds a little at large K.
    scale = expected.float().abs().mean().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.gpu
def test_cutlass_scaled_mm_wrapper_on_gpu():
    a, b, a_scale, b_scale = _operands(8, 128, 128, True, True, "cuda")
    out = cutlass_scaled_mm(a, b, a_scale.reshape(8, 1), b_scale.reshape(1, 128), torch.bfloat16)
    expected = cutlass_scaled_mm_ref(a, b, a_scale, b_scale, torch.bfloat16)
    torch.testing.assert_close(
        out.float(), expected.float(), rtol=1e-2, atol=1e-2 * expected.float().abs().mean().item()
    )
