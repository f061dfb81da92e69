"""`w8a8_block_fp8_matmul`: the reference against a group-by-group float64 sum, block
quantization of weights, the block-fp8 Triton kernels under the interpreter (CPU), the GEMM
kernel against the reference on a GPU over shapes and dtypes (and in a CUDA graph), and the
launch tables."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.dispatch import has_op
from shoal.kernels.per_token_group_quant_fp8 import per_token_group_quant_fp8, per_token_group_quant_fp8_ref
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX
from shoal.kernels.w8a8_block_fp8_matmul import (
    dequantize_block_fp8,
    quantize_block_fp8,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
)
from tests.kernels.interpreter import needs_triton, run_interpreter_check


def _grouped_sum(a, b, a_scale, b_scale, block_size) -> torch.Tensor:
    """out[m, n] = sum_g a_scale[m, g] * b_scale[n // bn, g] * (a[m, g] . b[n, g]), in float64."""
    block_n, block_k = block_size
    m, k = a.shape
    n = b.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    for g in range(a_scale.shape[1]):
        cols = slice(g * block_k, min((g + 1) * block_k, k))
        partial = a[:, cols].double() @ b[:, cols].double().t()  # [m, n]
        b_s = b_scale[:, g].double().repeat_interleave(block_n)[:n]
        out += partial * a_scale[:, g : g + 1].double() * b_s[None, :]
    return out


@pytest.mark.parametrize("block_size", [(16, 16), (32, 16), (128, 128)])
def test_reference_is_the_grouped_sum(block_size):
    gen = torch.Generator().manual_seed(0)
    a, a_scale = per_token_group_quant_fp8_ref(torch.randn(9, 200, generator=gen), block_size[1])
    b, b_scale = quantize_block_fp8(torch.randn(72, 200, generator=gen), block_size)  # short last blocks
    out = w8a8_block_fp8_matmul(a, b, a_scale, b_scale, block_size, torch.float32)  # CPU: the reference
    assert out.shape == (9, 72) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _grouped_sum(a, b, a_scale, b_scale, block_size), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit a \\[72, 200\\] weight"):
        w8a8_block_fp8_matmul_ref(a, b, a_scale, b_scale[:, :1], block_size, torch.float32)


def test_block_quantization():
    w = torch.randn(3, 40, 50, generator=torch.Generator().manual_seed(1))
    w[0, :16, :16] = 0  # an all-zero block keeps scale 1
    q, scale_inv = quantize_block_fp8(w, (16, 16))
    assert q.dtype == FP8_DTYPE and scale_inv.shape == (3, 3, 4) and scale_inv[0, 0, 0] == 1
    block = w[1, 16:32, 48:50]  # a short last block
    assert scale_inv[1, 1, 3] == block.abs().max() / FP8_MAX
    deq = dequantize_block_fp8(q, scale_inv, (16, 16))
    # e4m3 rounding: half a step of 2^-3 relative for normal values, half the subnormal step
    # (2^-9 of the block's scale) for the block's smallest.
    scale = scale_inv.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :40, :50]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()


@needs_triton
def test_block_fp8_triton_kernels_under_the_interpreter() -> None:
    """per_token_group_quant_fp8, w8a8_block_fp8_matmul and fused_moe_block_fp8."""
    run_interpreter_check("tests.kernels.triton_block_fp8_check")


@needs_triton
def test_launch_tables(tmp_path, monkeypatch) -> None:
    import json

    from shoal.kernels.triton import block_fp8_config as cfg
    from shoal.kernels.triton.fused_moe_config import TOKEN_COUNTS, warm_up_token_counts

    table = cfg.launch_table(7168, 2048, "cpu", (128, 128))
    assert set(table) == set(TOKEN_COUNTS) and cfg.nearest_launch(table, 3) == cfg.heuristic_launch(4)
    counts = warm_up_token_counts(table, 8192)  # type: ignore[arg-type]
    assert {cfg.nearest_launch(table, n) for n in counts} == {cfg.nearest_launch(table, n) for n in range(1, 8193)}
    launch = cfg.BlockFp8Launch(64, 64, 4, 4, 4)
    (tmp_path / cfg.config_file_name(256, 512, "cpu", (128, 128))).write_text(json.dumps({"1": launch.to_json()}))
    monkeypatch.setattr(cfg, "CONFIG_DIR", tmp_path)
    cfg.launch_table.cache_clear()
    try:
        assert cfg.nearest_launch(cfg.launch_table(256, 512, "cpu", (128, 128)), 100) == launch
    finally:
        cfg.launch_table.cache_clear()


# ---- GPU -------------------------------------------------------------------------------------


def _gpu_operands(m: int, n: int, k: int, block_size: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b, b_scale = quantize_block_fp8(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5, block_size)
    a, a_scale = per_token_group_quant_fp8(x, block_size[1])
    return a, b, a_scale, b_scale


def _assert_close_to_reference(out, a, b, a_scale, b_scale, block_size):
    expected = w8a8_block_fp8_matmul_ref(a, b, a_scale, b_scale, block_size, torch.float32)
    error = ((out.float() - expected).abs().max() / (expected.abs().max() + 1e-6)).item()
    # float32 output: Hopper's fp8 tensor cores accumulate a dot in less than float32 precision
    # (about 14 bits, DeepSeek-V3 report section 3.3.2), which the per-block scaling bounds.
    assert error < {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 5e-4}[out.dtype], error


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 100, 512, 4096])
@pytest.mark.parametrize(
    ("n", "k", "block_size"),
    [
        (7168, 2048, (128, 128)),  # DeepSeek-V3 down_proj (TP=1 expert size)
        (4096, 7168, (128, 128)),  # gate_up of a dense layer at TP=8
        (576, 7168, (128, 128)),  # kv_a_proj_with_mqa: N not a multiple of the block
        (1000, 1000, (128, 128)),  # short last blocks both ways
        (512, 256, (64, 64)),
    ],
)
def test_triton_matches_reference_on_gpu(dtype, m, n, k, block_size):
    a, b, a_scale, b_scale = _gpu_operands(m, n, k, block_size, dtype)
    assert has_op("w8a8_block_fp8_matmul", a)
    out = w8a8_block_fp8_matmul(a, b, a_scale, b_scale, block_size, dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    _assert_close_to_reference(out, a, b, a_scale, b_scale, block_size)


@pytest.mark.gpu
def test_column_major_activation_scales_on_gpu():
    a, b, a_scale, b_scale = _gpu_operands(37, 1024, 512, (128, 128), torch.bfloat16)
    column_major = a_scale.t().contiguous().t()
    out = w8a8_block_fp8_matmul(a, b, column_major, b_scale, (128, 128), torch.bfloat16)
    assert torch.equal(out, w8a8_block_fp8_matmul(a, b, a_scale, b_scale, (128, 128), torch.bfloat16))


@pytest.mark.gpu
def test_every_heuristic_launch_runs_on_gpu():
    from shoal.kernels.triton import block_fp8_config as cfg
    from shoal.kernels.triton.w8a8_block_fp8_matmul import triton_w8a8_block_fp8_matmul

    a, b, a_scale, b_scale = _gpu_operands(300, 2048, 1024, (128, 128), torch.bfloat16)
    for launch in sorted(set(cfg.launch_table(2048, 1024, "none", (128, 128)).values()), key=str):
        out = torch.empty(300, 2048, device="cuda", dtype=torch.bfloat16)
        triton_w8a8_block_fp8_matmul(out, a, b, a_scale, b_scale, 128, 128, launch=launch)
        _assert_close_to_reference(out, a, b, a_scale, b_scale, (128, 128))


@pytest.mark.gpu
def test_block_fp8_linear_in_a_cuda_graph():
    """The layer's decode step (quantize, GEMM) captures and replays on new inputs."""
    from shoal.layers.linear import ReplicatedLinear
    from shoal.layers.quantization.fp8_config import Fp8Config
    from shoal.models.loader import default_dtype

    config = Fp8Config(is_checkpoint_fp8=True, weight_block_size=(128, 128))
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        layer = ReplicatedLinear(1024, 768, bias=False, quant_config=config)
    w, scale_inv = quantize_block_fp8(torch.randn(768, 1024, device="cuda") * 0.03, (128, 128))
    layer.weight.weight_loader(layer.weight, w)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale_inv)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    layer(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    a, a_scale = per_token_group_quant_fp8_ref(x, 128)
    _assert_close_to_reference(out, a, w, a_scale, scale_inv, (128, 128))


@pytest.mark.gpu
def test_block_fp8_linear_warm_up_runs_each_launch_once():
    from shoal.kernels.triton import block_fp8_config as cfg
    from shoal.kernels.triton.fused_moe_config import device_name
    from shoal.layers.linear import ReplicatedLinear
    from shoal.layers.quantization.fp8_config import Fp8Config
    from shoal.models.loader import default_dtype

    config = Fp8Config(is_checkpoint_fp8=True, weight_block_size=(128, 128))
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        layer = ReplicatedLinear(512, 384, bias=False, quant_config=config)
    layer.weight.data.zero_()
    layer.weight_scale_inv.data.fill_(1.0)
    calls: list[int] = []
    original = layer.linear_method.apply
    layer.linear_method.apply = lambda lay, x, bias: calls.append(x.shape[0]) or original(lay, x, bias)  # type: ignore[method-assign]
    layer.warm_up_kernels(2048)
    table = cfg.launch_table(384, 512, device_name(torch.device("cuda")), (128, 128))
    assert {cfg.nearest_launch(table, n) for n in calls} == {cfg.nearest_launch(table, n) for n in range(1, 2049)}
    layer.warm_up_kernels(2048)  # the shape is compiled: nothing runs
    assert len(calls) == len(set(calls))
