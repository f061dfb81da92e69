from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from tests.kernels.csrc_utils import DTYPES as CSRC_DTYPES
from tests.kernels.csrc_utils import csrc_op, tolerance


@pytest.mark.parametrize("num_tokens,d", [(1, 8), (13, 64), (40, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(num_tokens, d, dtype):
    x = torch.randn(num_tokens, 2 * d, dtype=dtype)
    gate, up = x[:, :d], x[:, d:]
    out = torch.empty(num_tokens, d, dtype=dtype)
    silu_and_mul_ref(out, x)
    assert torch.equal(out, F.silu(gate) * up)
    torch.testing.assert_close(
        out.double(),
        (gate.double() * torch.sigmoid(gate.double())) * up.double(),
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
        atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
    )
    out2 = torch.empty_like(out)
    silu_and_mul(out2, x)
    assert torch.equal(out, out2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,d", [(1, 8), (13, 64), (40, 1536), (7, 100)])
@pytest.mark.parametrize("dtype", CSRC_DTYPES)
def test_silu_and_mul_csrc_matches_reference(num_tokens, d, dtype):
    x = torch.randn(num_tokens, 2 * d, dtype=dtype, device="cuda")
    out, expected = (
        torch.empty(num_tokens, d, dtype=dtype, device="cuda"),
        torch.empty(num_tokens, d, dtype=dtype, device="cuda"),
    )
    csrc_op("silu_and_mul")(out, x)
    silu_and_mul_ref(expected, x)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.gpu
def test_silu_and_mul_csrc_strided_input():
    wide = torch.randn(6, 3 * 128, dtype=torch.bfloat16, device="cuda")
    x = wide[:, :256]  # rows 384 apart
    out, expected = (
        torch.empty(6, 128, dtype=torch.bfloat16, device="cuda"),
        torch.empty(6, 128, dtype=torch.bfloat16, device="cuda"),
    )
    csrc_op("silu_and_mul")(out, x)
    silu_and_mul_ref(expected, x)
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))
