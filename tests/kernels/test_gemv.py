"""`gemv`: the reference, the Triton kernel under the interpreter (CPU) and on a GPU, and when the
unquantized linear method takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import gemv as gemv_module
from shoal.kernels.gemv import gemv_kernel_for, gemv_ref, linear, swiglu_linear, use_gemv
from shoal.kernels.triton import triton_available
from shoal.layers.linear import ReplicatedLinear, RowParallelLinear
from tests.kernels.interpreter import needs_triton, run_interpreter_check


@pytest.mark.parametrize("has_bias", [False, True])
def test_reference_is_f_linear(has_bias: bool) -> None:
    x, weight = torch.randn(3, 16), torch.randn(5, 16)
    bias = torch.randn(5) if has_bias else None
    out = torch.empty(3, 5)
    gemv_ref(out, x, weight, bias)
    assert torch.equal(out, F.linear(x, weight, bias))
    assert torch.equal(linear(x, weight, bias), out)  # the dispatching op runs F.linear on CPU


@needs_triton
def test_triton_kernel_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_gemv_check")


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 14336), (4096, 4096)])  # Llama-3.1-8B down and o_proj
@pytest.mark.parametrize("rows", [1, 2])
def test_swiglu_kernel_on_gpu(n: int, k: int, rows: int) -> None:
    """The fused activation and down projection against silu_and_mul then F.linear."""
    from shoal.kernels.triton.gemv import triton_gemv
    from shoal.layers.activation import silu_and_mul

    gate_up = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    expected = F.linear(silu_and_mul(gate_up).double(), weight.double())
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    triton_gemv(out, gate_up, weight, None, swiglu=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    fused = swiglu_linear(gate_up, weight, None)
    assert (fused is not None) == (rows == 1)  # taken where the plain gemv is
    if fused is not None:
        assert torch.equal(fused, out)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (4096, 14336)])  # Llama-3.1-8B qkv, o_proj, down
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_triton_kernel_on_gpu(n: int, k: int, rows: int) -> None:
    from shoal.kernels.triton.gemv import GemvTuning, triton_gemv

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.double(), weight.double(), bias.double())
    for tuning in (GemvTuning(), GemvTuning(programs_per_sm=8)):  # one pass, and split-K
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        triton_gemv(out, x, weight, bias, tuning)
        torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    assert (gemv_kernel_for(x, weight) is not None) == (rows == 1)  # the calls the kernel is meant for
    linear = F.linear(x, weight, bias).double()
    torch.testing.assert_close(out.double(), linear, rtol=2e-2, atol=2e-2)


def test_cpu_and_float32_stay_with_f_linear() -> None:
    assert use_gemv(1, 4096, 4096) and use_gemv(1, 6144, 4096)  # Llama-3.1-8B o_proj and qkv at batch 1
    assert use_gemv(1, 4096, 14336)  # and down
    assert not use_gemv(2, 4096, 4096) and not use_gemv(1, 28672, 4096)
    assert not use_gemv(1, 128256, 4096) and not use_gemv(1, 1024, 2048)
    for dtype in (torch.float32, torch.bfloat16):
        assert gemv_kernel_for(torch.randn(1, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)) is None
    layer = ReplicatedLinear(64, 32, bias=True)
    layer.weight.data.normal_()  # parameters start uninitialized (possibly NaN)
    layer.bias.data.normal_()
    x = torch.randn(1, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(not triton_available(), reason="gemv_kernel_for reads the kernel's tuning from its module")
def test_linear_takes_a_registered_kernel_for_half_precision_only(monkeypatch) -> None:
    calls = []

    def fake_kernel(out, x, weight, bias):
        calls.append(x.shape)
        gemv_ref(out, x, weight, bias)

    monkeypatch.setattr(gemv_module, "registered_kernel", lambda name, tensor: fake_kernel)
    monkeypatch.setattr(gemv_module, "use_gemv", lambda num_rows, n, k: num_rows <= 4)  # any shape here
    assert gemv_kernel_for(torch.randn(1, 64), torch.randn(32, 64)) is None
    assert gemv_kernel_for(torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)) is None
    layer = ReplicatedLinear(64, 32, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(1, 64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and calls == []
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)  # leading dims flattened into rows
    layer = layer.to(torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [(2, 64)]


def test_row_parallel_swiglu_without_a_fused_kernel_is_the_two_ops() -> None:
    layer = RowParallelLinear(8, 6, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    gate_up = torch.randn(3, 16)
    expected = layer(F.silu(gate_up[:, :8]) * gate_up[:, 8:])
    torch.testing.assert_close(layer.forward_swiglu(gate_up), expected)
    with pytest.raises(ValueError, match="expected 16"):
        swiglu_linear(torch.randn(1, 12), layer.weight, None)


@pytest.mark.skipif(not triton_available(), reason="gemv_kernel_for reads the kernel's tuning from its module")
def test_row_parallel_swiglu_takes_the_fused_kernel_at_one_row(monkeypatch) -> None:
    calls = []

    def fake_kernel(out, x, weight, bias, swiglu=False):
        calls.append((x.shape[0], swiglu))
        d = x.shape[1] // 2
        gemv_ref(out, F.silu(x[:, :d]) * x[:, d:] if swiglu else x, weight, bias)

    monkeypatch.setattr(gemv_module, "registered_kernel", lambda name, tensor: fake_kernel)
    monkeypatch.setattr(gemv_module, "use_gemv", lambda num_rows, n, k: num_rows == 1)
    layer = RowParallelLinear(64, 32, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    for rows in (1, 3):
        gate_up = torch.randn(rows, 128, dtype=torch.bfloat16)
        expected = F.linear(F.silu(gate_up[:, :64]) * gate_up[:, 64:], layer.weight, layer.bias)
        torch.testing.assert_close(layer.forward_swiglu(gate_up), expected)
    assert calls == [(1, True)]  # one fused launch at one row; three rows ran silu_and_mul and F.linear
