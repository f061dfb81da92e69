from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from shoal.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.kernels.csrc_utils import DTYPES as CSRC_DTYPES
from tests.kernels.csrc_utils import csrc_op, tolerance

SHAPES = [(1, 8), (7, 64), (33, 576)]
DTYPES = [torch.float32, torch.bfloat16]


def _hf_norm(weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_bit_for_bit(shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    out = torch.empty_like(x)
    rms_norm_ref(out, x, weight, 1e-6)
    assert torch.equal(out, _hf_norm(weight, 1e-6)(x))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_formula(shape):
    """The op computes in float32 whatever the input dtype; compare with a float64 formula."""
    x, weight = torch.randn(shape), torch.randn(shape[-1])
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    out = torch.empty_like(x)
    rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_is_add_then_norm(shape, dtype):
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    expected_residual = x + residual
    expected = _hf_norm(weight, 1e-6)(expected_residual)
    fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, expected)


def test_dispatch_uses_the_reference_on_cpu():
    x, residual, weight = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    x_ref, residual_ref = x.clone(), residual.clone()
    fused_add_rms_norm(x, residual, weight, 1e-6)
    fused_add_rms_norm_ref(x_ref, residual_ref, weight, 1e-6)
    assert torch.equal(x, x_ref) and torch.equal(residual, residual_ref)


# --- the compiled op against the reference (GPU) ---------------------------------------------------

GPU_SHAPES = [(1, 8), (7, 64), (33, 576), (128, 4096), (5, 100)]  # 100: not whole 16-byte packs


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_rms_norm_csrc_matches_reference(shape, dtype):
    x = torch.randn(shape, dtype=dtype, device="cuda")
    weight = torch.randn(shape[-1], dtype=dtype, device="cuda")
    out, expected = torch.empty_like(x), torch.empty_like(x)
    csrc_op("rms_norm")(out, x, weight, 1e-6)
    rms_norm_ref(expected, x, weight, 1e-6)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_fused_add_rms_norm_csrc_matches_reference(shape, dtype):
    x = torch.randn(shape, dtype=dtype, device="cuda")
    residual = torch.randn(shape, dtype=dtype, device="cuda")
    weight = torch.randn(shape[-1], dtype=dtype, device="cuda")
    x_ref, residual_ref = x.clone(), residual.clone()
    csrc_op("fused_add_rms_norm")(x, residual, weight, 1e-6)
    fused_add_rms_norm_ref(x_ref, residual_ref, weight, 1e-6)
    assert torch.equal(residual, residual_ref)  # one rounded add, as in the reference
    torch.testing.assert_close(x, x_ref, **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_rms_norm_csrc_strided_rows(dtype):
    """Per-head norms read column slices of the fused qkv projection: 2-D and 3-D views."""
    qkv = torch.randn(9, 6 * 64, dtype=dtype, device="cuda")
    weight = torch.randn(64, dtype=dtype, device="cuda")
    for x in (qkv[:, 64:128], qkv[:, 64:256].view(9, 3, 64)):
        out, expected = torch.empty_like(x), torch.empty_like(x)
        csrc_op("rms_norm")(out, x, weight, 1e-6)
        rms_norm_ref(expected, x, weight, 1e-6)
        torch.testing.assert_close(out, expected, **tolerance(dtype))
