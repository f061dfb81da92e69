"""fp8 linear layers: on-the-fly quantization, loading fp8 checkpoint tensors (per-tensor and
per-channel scales, fused parts, tensor-parallel shards), static activation scales, and the
`Fp8Config` read from a checkpoint's quantization_config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import has_op
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE, FP8_MAX, scaled_fp8_quant_ref
from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_linear_method,
)
from shoal.layers.quantization.base import UnquantizedLinearMethod
from shoal.layers.quantization.fp8 import Fp8LinearMethod
from shoal.layers.quantization.fp8_config import Fp8Config, checkpoint_quantization
from shoal.models.loader import default_dtype
from tests.layers.tp_utils import fake_tp_group

ON_THE_FLY = Fp8Config()
CHECKPOINT_DYNAMIC = Fp8Config(is_checkpoint_fp8=True)
CHECKPOINT_STATIC = Fp8Config(is_checkpoint_fp8=True, activation_scheme="static")

# e4m3 keeps 3 mantissa bits (relative rounding error up to 2^-4): quantizing both the weight
# and the activations of a random [32, 256] x [256, N] product gives about 3.5% relative
# (Frobenius) error; 5% is the bound.
FP8_REL_ERROR = 0.05


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's fp8 weight and its scale: a scalar per tensor, or [rows, 1] per channel."""
    w_fp8, scale = scaled_fp8_quant_ref(w, per_token=per_channel)
    return w_fp8, scale.reshape(()) if not per_channel else scale


def dequantize(layer) -> torch.Tensor:
    """The fp8 layer's weight as float, [output_size, input_size]."""
    return (layer.weight.float() * layer.weight_scale.reshape(1, -1)).t()


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    x_fp8, scale = scaled_fp8_quant_ref(x, per_token=True)
    return x_fp8.float() * scale


def load_float(layer, weight: torch.Tensor, bias: torch.Tensor | None = None, shards=None) -> None:
    """Load a float checkpoint weight (shards: [(shard_id, rows)]) and finish loading."""
    if shards is None:
        layer.weight.weight_loader(layer.weight, weight)
    else:
        for shard_id, rows in shards:
            layer.weight.weight_loader(layer.weight, weight[rows], shard_id)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    layer.process_weights_after_loading()


# ---- on-the-fly quantization ----------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_on_the_fly_fp8_linear_matches_float_within_fp8_error(cls, with_bias):
    gen = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 256, generator=gen), torch.randn(48, generator=gen), torch.randn(32, 256, generator=gen)
    layer = cls(256, 48, bias=with_bias, quant_config=ON_THE_FLY)
    load_float(layer, w, b if with_bias else None)
    expected = F.linear(x, w, b if with_bias else None)
    assert rel_error(layer(x), expected) < FP8_REL_ERROR


def test_on_the_fly_weight_is_column_major_fp8_with_per_channel_scales():
    w = torch.randn(24, 32)
    w[3] *= 100  # one large row: a per-channel scale keeps the other rows precise
    layer = ReplicatedLinear(32, 24, bias=False, quant_config=ON_THE_FLY)
    load_float(layer, w)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight.shape == (32, 24) and layer.weight.stride(0) == 1
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (24,)
    torch.testing.assert_close(layer.weight_scale, w.abs().amax(dim=1) / FP8_MAX)
    per_row_error = (dequantize(layer) - w).norm(dim=1) / w.norm(dim=1)
    assert per_row_error.max() < 0.05
    assert not layer.weight.requires_grad


def test_fp8_forward_is_the_dequantized_product():
    """y = fake_quant(x) @ dequant(W)^T + b exactly (up to float32 summation order), with
    leading dimensions kept."""
    gen = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(16, 64, generator=gen), torch.randn(16, generator=gen), torch.randn(2, 5, 64, generator=gen)
    layer = ColumnParallelLinear(64, 16, bias=True, quant_config=ON_THE_FLY)
    load_float(layer, w, b)
    y = layer(x)
    assert y.shape == (2, 5, 16) and y.dtype == x.dtype
    expected = F.linear(fake_quant_per_token(x.reshape(10, 64)), dequantize(layer), b).reshape(2, 5, 16)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_fp8_layer_handles_an_empty_batch():
    layer = ReplicatedLinear(32, 16, bias=True, quant_config=ON_THE_FLY)
    load_float(layer, torch.randn(16, 32), torch.randn(16))
    assert layer(torch.randn(0, 32)).shape == (0, 16)


# ---- fp8 checkpoint tensors -----------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
def test_fused_qkv_parts_keep_their_own_scales(per_channel):
    """q, k and v quantized per tensor with different scales (as a calibration would) load
    into one fp8 weight whose per-row scales reproduce every part exactly."""
    gen = torch.Generator().manual_seed(2)
    parts = {"q": 1.0, "k": 5.0, "v": 0.2}  # very different ranges, so very different scales
    weights = {sid: torch.randn(8 if sid == "q" else 4, 16, generator=gen) * s for sid, s in parts.items()}
    layer = QKVParallelLinear(16, 2, 4, 2, bias=False, quant_config=CHECKPOINT_DYNAMIC)
    expected = []
    for shard_id, w in weights.items():
        w_fp8, scale = quantize(w, per_channel)
        layer.weight.weight_loader(layer.weight, w_fp8, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
        expected.append(w_fp8.float() * scale.reshape(-1, 1))
    layer.process_weights_after_loading()
    assert torch.equal(dequantize(layer), torch.cat(expected))


def test_fused_checkpoint_tensor_with_one_per_tensor_scale():
    """A checkpoint that stores gate_up fused, with one scale for the whole tensor."""
    w_fp8, scale = quantize(torch.randn(20, 16), per_channel=False)
    layer = MergedColumnParallelLinear(16, [10, 10], bias=False, quant_config=CHECKPOINT_DYNAMIC)
    layer.weight.weight_loader(layer.weight, w_fp8)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    layer.process_weights_after_loading()
    assert torch.equal(dequantize(layer), w_fp8.float() * scale)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_tp_shards_of_fp8_weights_and_scales(rank, per_channel):
    """Each rank holds its rows (column-parallel) or columns (row-parallel) of the weight and
    the scales of its rows; a per-tensor scale covers every rank's rows."""
    gen = torch.Generator().manual_seed(3)
    gate, up, down = (torch.randn(*shape, generator=gen) for shape in ((12, 16), (12, 16), (16, 12)))
    (gate_q, gate_s), (up_q, up_s), (down_q, down_s) = (quantize(w, per_channel) for w in (gate, up, down))
    with fake_tp_group(rank):
        merged = MergedColumnParallelLinear(16, [12, 12], bias=False, quant_config=CHECKPOINT_DYNAMIC)
        row = RowParallelLinear(12, 16, bias=False, quant_config=CHECKPOINT_DYNAMIC)
    for shard_id, w_fp8, scale in ((0, gate_q, gate_s), (1, up_q, up_s)):
        merged.weight.weight_loader(merged.weight, w_fp8, shard_id)
        merged.weight_scale.weight_loader(merged.weight_scale, scale, shard_id)
    row.weight.weight_loader(row.weight, down_q)
    row.weight_scale.weight_loader(row.weight_scale, down_s)
    merged.process_weights_after_loading()
    row.process_weights_after_loading()

    def half(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.chunk(2, dim=dim)[rank]

    gate_deq, up_deq = gate_q.float() * gate_s.reshape(-1, 1), up_q.float() * up_s.reshape(-1, 1)
    assert torch.equal(dequantize(merged), torch.cat((half(gate_deq), half(up_deq))))
    assert torch.equal(dequantize(row), half(down_q.float() * down_s.reshape(-1, 1), dim=1))


def test_checkpoint_scale_of_the_wrong_size_is_rejected():
    layer = ColumnParallelLinear(16, 8, bias=False, quant_config=CHECKPOINT_DYNAMIC)
    with pytest.raises(ValueError, match="weight_scale has 3 entries"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(3))


def test_static_input_scale_of_fused_parts_is_their_max():
    """Static activation scales: a fused layer uses the largest of its parts' scales, and
    quantizes its input with it (no per-token scales)."""
    gen = torch.Generator().manual_seed(4)
    layer = MergedColumnParallelLinear(32, [8, 8], bias=False, quant_config=CHECKPOINT_STATIC)
    for shard_id, input_scale in ((0, 0.01), (1, 0.03)):
        w_fp8, scale = quantize(torch.randn(8, 32, generator=gen), per_channel=False)
        layer.weight.weight_loader(layer.weight, w_fp8, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(input_scale))
    layer.process_weights_after_loading()
    assert layer.input_scale.item() == pytest.approx(0.03)
    x = torch.randn(7, 32, generator=gen)
    x_deq = (x / 0.03).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * layer.input_scale
    torch.testing.assert_close(layer(x), F.linear(x_deq, dequantize(layer)), rtol=1e-5, atol=1e-5)


# ---- which layers are fp8: Fp8Config ---------------------------------------------------------


def test_ignored_layers_stay_float_and_fused_layers_need_all_parts_ignored():
    config = Fp8Config(
        is_checkpoint_fp8=True,
        ignored_layers=("model.layers.0.mlp.down_proj", "re:model\\.layers\\.1\\.self_attn\\.[qkv]_proj", "lm_head"),
    )
    assert isinstance(get_linear_method(config, "model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(get_linear_method(config, "model.layers.1.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert isinstance(get_linear_method(config, "model.layers.1.mlp.down_proj"), Fp8LinearMethod)
    assert isinstance(get_linear_method(None, "model.layers.1.mlp.down_proj"), UnquantizedLinearMethod)
    partly = Fp8Config(is_checkpoint_fp8=True, ignored_layers=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(ValueError, match="only some are quantized"):
        partly.is_layer_skipped("model.layers.0.self_attn.qkv_proj")


class _HFConfig:
    def __init__(self, quantization_config: dict | None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


def _compressed_tensors(weights: dict, input_activations: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **extra,
    }


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKEN_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
FP8_STATIC_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}


@pytest.mark.parametrize(
    "quantization_config,expected",
    [
        (None, Fp8Config()),
        ({"quant_method": "fp8"}, CHECKPOINT_DYNAMIC),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
            Fp8Config(True, "static", ("lm_head",)),
        ),
        (_compressed_tensors(FP8_WEIGHTS, FP8_TOKEN_ACTIVATIONS), Fp8Config(True, "dynamic", ("lm_head",))),
        (
            _compressed_tensors({**FP8_WEIGHTS, "strategy": "tensor"}, FP8_STATIC_ACTIVATIONS),
            Fp8Config(True, "static", ("lm_head",)),
        ),
        (_compressed_tensors(FP8_WEIGHTS, None), Fp8Config(True, "dynamic", ("lm_head",))),
    ],
)
def test_fp8_config_from_checkpoint(quantization_config, expected):
    assert Fp8Config.from_hf_config(_HFConfig(quantization_config)) == expected
    assert checkpoint_quantization(_HFConfig(quantization_config)) == (None if quantization_config is None else "fp8")


@pytest.mark.parametrize(
    "quantization_config,message",
    [
        ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "block-wise fp8"),
        ({"quant_method": "fp8", "activation_scheme": "per-channel"}, "activation_scheme"),
        (_compressed_tensors({**FP8_WEIGHTS, "type": "int"}, None), "weights"),
        (_compressed_tensors({**FP8_WEIGHTS, "strategy": "block"}, None), "weights"),
        (_compressed_tensors(FP8_WEIGHTS, {**FP8_STATIC_ACTIVATIONS, "strategy": "token"}), "per tensor"),
        (_compressed_tensors(FP8_WEIGHTS, None, format="pack-quantized"), "format"),
    ],
)
def test_unsupported_checkpoint_quantization_is_rejected(quantization_config, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization(_HFConfig(quantization_config))


def test_unused_checkpoint_tensors():
    assert Fp8Config(True).is_unused_tensor("model.layers.0.self_attn.q_proj.input_scale")
    assert not CHECKPOINT_STATIC.is_unused_tensor("model.layers.0.self_attn.q_proj.input_scale")
    assert CHECKPOINT_STATIC.is_unused_tensor("model.layers.0.self_attn.k_scale")
    assert CHECKPOINT_STATIC.is_unused_tensor("model.layers.0.mlp.down_proj.weight_zero_point")
    assert not CHECKPOINT_STATIC.is_unused_tensor("model.layers.0.mlp.down_proj.weight_scale")


# ---- GPU: the compiled ops ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_fp8_linear_on_cuda_uses_the_compiled_ops(dtype, num_tokens):
    """On CUDA in a half dtype the layer runs scaled_fp8_quant and cutlass_scaled_mm compiled;
    its output equals the references on the same tensors (to bf16/fp16 rounding, and the odd
    activation rounded to a neighbouring fp8 value) and the float product within fp8 error."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(384, 512, generator=gen), torch.randn(384, generator=gen)
    x = torch.randn(num_tokens, 512, generator=gen)
    with default_dtype(dtype), torch.device(device):
        layer = ColumnParallelLinear(512, 384, bias=True, quant_config=ON_THE_FLY)
    load_float(layer, w.to(device, dtype), b.to(device, dtype))
    x_cuda = x.to(device, dtype)
    assert has_op("cutlass_scaled_mm", x_cuda) and has_op("scaled_fp8_quant", x_cuda)
    y = layer(x_cuda)
    assert y.dtype == dtype and y.shape == (num_tokens, 384)
    expected = F.linear(fake_quant_per_token(x_cuda.float()), dequantize(layer), layer.bias.float())
    assert rel_error(y, expected) < 1e-2
    assert rel_error(y, F.linear(x, w, b).to(device)) < FP8_REL_ERROR
