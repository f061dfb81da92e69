from __future__ import annotations

import pytest
import torch

from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, scaled_fp8_quant, scaled_fp8_quant_ref
from tests.kernels.csrc_utils import DTYPES, csrc_op

# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of the value, or half the
# smallest subnormal (2^-10) near zero.
REL_ERROR, ABS_ERROR = 2.0**-4, 2.0**-10


def _assert_dequantizes(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    deq = out.to(torch.float32) * scale
    bound = (x.float().abs() * REL_ERROR + ABS_ERROR * scale).expand_as(deq)
    assert bool(((deq - x.float()).abs() <= bound).all())


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_scale_is_amax_over_fp8_max(per_token, dtype):
    x = torch.randn(7, 64, dtype=dtype) * 3
    out, scale = scaled_fp8_quant(x, per_token=per_token)
    assert out.dtype == FP8_DTYPE and out.shape == x.shape
    amax = x.float().abs().amax(-1, keepdim=True) if per_token else x.float().abs().amax().reshape(1)
    torch.testing.assert_close(scale, amax / FP8_MAX)
    assert out.float().abs().max() == FP8_MAX  # the largest element maps to the top of the range
    _assert_dequantizes(x, out, scale)


def test_static_scale_saturates():
    x = torch.tensor([[0.5, -1.0, 1000.0, -1000.0]])
    out, scale = scaled_fp8_quant_ref(x, torch.tensor([0.5]))
    assert scale.item() == 0.5
    assert out.float().tolist() == [[1.0, -2.0, FP8_MAX, -FP8_MAX]]


def test_all_zero_rows_get_the_floor_scale():
    out, scale = scaled_fp8_quant_ref(torch.zeros(2, 16), per_token=True)
    assert torch.equal(scale, torch.full((2, 1), MIN_SCALE))
    assert torch.count_nonzero(out.float()) == 0


def test_static_per_token_is_rejected():
    with pytest.raises(ValueError):
        scaled_fp8_quant_ref(torch.zeros(2, 16), torch.ones(1), per_token=True)


# --- the compiled op against the reference (GPU): bit for bit --------------------------------------


def _run_compiled(x: torch.Tensor, mode: str) -> None:
    per_token = mode == "dynamic_per_token"
    static_scale = torch.tensor([x.float().abs().max().item() / 300.0], device="cuda") if mode == "static" else None
    expected, expected_scale = scaled_fp8_quant_ref(x, static_scale, per_token)
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device="cuda")
    if static_scale is not None:
        scale = static_scale
    else:
        scale = torch.empty((*x.shape[:-1], 1) if per_token else (1,), device="cuda")
    csrc_op("scaled_fp8_quant")(out, x, scale, static_scale is not None, per_token)
    # torch divides a CUDA tensor by a Python scalar as a multiply by its reciprocal, so the
    # reference's dynamic scale may sit one float32 ulp from the kernel's exact amax / 448.
    torch.testing.assert_close(scale, expected_scale, rtol=2.5e-7, atol=0)
    # Given the same scale, the quantized values agree bit for bit (tensor / tensor divides exactly).
    expected = (x.float() / scale).clamp(-448.0, 448.0).to(FP8_DTYPE)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["static", "dynamic_per_tensor", "dynamic_per_token"])
@pytest.mark.parametrize("shape", [(1, 16), (33, 4096), (7, 100), (300, 5120)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp8_quant_csrc_matches_reference(mode, shape, dtype):
    _run_compiled(torch.randn(shape, device="cuda").to(dtype) * 5, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["static", "dynamic_per_tensor", "dynamic_per_token"])
def test_scaled_fp8_quant_csrc_strided_rows_and_zero_rows(mode):
    wide = torch.randn(9, 3 * 256, device="cuda", dtype=torch.bfloat16)
    wide[4] = 0  # an all-zero row: floor scale, zeros out
    _run_compiled(wide[:, 256:512], mode)


@pytest.mark.gpu
def test_scaled_fp8_quant_wrapper_on_gpu():
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    out, scale = scaled_fp8_quant(x, per_token=True)
    assert out.dtype == FP8_DTYPE and scale.shape == (5, 1)
    _assert_dequantizes(x, out, scale)
