"""Block-wise fp8 linear layers and experts (DeepSeek-V3's scheme): the `Fp8Config` of a
`weight_block_size` checkpoint, the layer's forward against the dequantized product, weights
and block scales cut together under tensor parallelism (column, row, fused qkv / gate_up,
stacked and per-expert experts, expert parallelism), and the cuts that do not fall on block
boundaries refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.distributed import parallel_state
from shoal.kernels.fused_moe_block_fp8 import fake_quant_per_token_group, fused_moe_block_fp8_ref
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE
from shoal.kernels.w8a8_block_fp8_matmul import dequantize_block_fp8, quantize_block_fp8
from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from shoal.layers.moe import FusedMoE
from shoal.layers.quantization.fp8_block import Fp8BlockLinearMethod
from shoal.layers.quantization.fp8_block_moe import Fp8BlockMoEMethod
from shoal.layers.quantization.fp8_config import Fp8Config, checkpoint_quantization
from tests.layers.tp_utils import fake_tp_group

BLOCK_128 = Fp8Config(is_checkpoint_fp8=True, weight_block_size=(128, 128))
DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


class _HFConfig:
    def __init__(self, quantization_config: dict):
        self.quantization_config = quantization_config


def test_deepseek_v3_quantization_config():
    config = Fp8Config.from_hf_config(_HFConfig(DEEPSEEK_V3))
    assert config == BLOCK_128 and config.is_block_wise
    assert checkpoint_quantization(_HFConfig(DEEPSEEK_V3)) == "fp8"
    ignored = Fp8Config.from_hf_config(_HFConfig({**DEEPSEEK_V3, "modules_to_not_convert": ["lm_head"]}))
    assert ignored.ignored_layers == ("lm_head",) and ignored.weight_block_size == (128, 128)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"activation_scheme": "static"}, "needs activation_scheme 'dynamic'"),
        ({"fmt": "e5m2"}, "only e4m3"),
        ({"weight_block_size": [128]}, "two positive integers"),
        ({"weight_block_size": [128, 0]}, "two positive integers"),
    ],
)
def test_unsupported_block_configs_are_rejected(changes, message):
    with pytest.raises(ValueError, match=message):
        Fp8Config.from_hf_config(_HFConfig({**DEEPSEEK_V3, **changes}))


def _load(layer, tensors: dict) -> None:
    """tensors: {shard_id: (w_fp8, scale_inv)} of checkpoint tensors (shard_id None: one tensor)."""
    for shard_id, (w_fp8, scale_inv) in tensors.items():
        for param, loaded in ((layer.weight, w_fp8), (layer.weight_scale_inv, scale_inv)):
            if shard_id is None:
                param.weight_loader(param, loaded)
            else:
                param.weight_loader(param, loaded, shard_id)
    layer.process_weights_after_loading()


def _dequantized(layer) -> torch.Tensor:
    return dequantize_block_fp8(layer.weight, layer.weight_scale_inv, layer.linear_method.block_size)


def test_forward_is_the_product_of_the_rounded_activations_and_dequantized_weight():
    """128 x 128 blocks on a [200, 300] weight (short last blocks both ways), with a bias and
    leading dimensions: y = fake_quant_groups(x) @ dequant(W)^T + b."""
    gen = torch.Generator().manual_seed(0)
    w, b, x = (
        torch.randn(200, 300, generator=gen),
        torch.randn(200, generator=gen),
        torch.randn(2, 5, 300, generator=gen),
    )
    layer = ReplicatedLinear(300, 200, bias=True, quant_config=BLOCK_128, prefix="m.proj")
    assert isinstance(layer.linear_method, Fp8BlockLinearMethod)
    w_fp8, scale_inv = quantize_block_fp8(w, (128, 128))
    assert scale_inv.shape == (2, 3)
    layer.bias.weight_loader(layer.bias, b)
    _load(layer, {None: (w_fp8, scale_inv)})
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.dtype == torch.float32
    y = layer(x)
    assert y.shape == (2, 5, 200) and y.dtype == x.dtype
    expected = F.linear(fake_quant_per_token_group(x.reshape(10, 300), 128), _dequantized(layer), b).reshape(2, 5, 200)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # And within fp8 error of the float layer: ~2.5% for the weight, ~2.5% for the activations.
    assert ((y - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()).item() < 0.05
    assert layer(torch.randn(0, 300)).shape == (0, 200)


def _half(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim=dim)[rank]


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_shards_of_weights_and_block_scales(rank):
    """Each rank's weight and scales dequantize to its half of the checkpoint's dequantized
    weight: gate/up fused (each part per tensor, and one fused tensor), q/k/v with their own
    scales, row-parallel down."""
    gen = torch.Generator().manual_seed(1)
    block = (128, 128)
    gate, up = (quantize_block_fp8(torch.randn(512, 256, generator=gen), block) for _ in range(2))
    q, k, v = (
        quantize_block_fp8(torch.randn(n, 256, generator=gen) * s, block) for n, s in ((512, 1), (256, 5), (256, 0.2))
    )
    down = quantize_block_fp8(torch.randn(256, 512, generator=gen), block)
    fused = (torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]))
    with fake_tp_group(rank):
        merged = MergedColumnParallelLinear(256, [512, 512], bias=False, quant_config=BLOCK_128)
        merged_fused = MergedColumnParallelLinear(256, [512, 512], bias=False, quant_config=BLOCK_128)
        qkv = QKVParallelLinear(256, 128, 4, 2, bias=False, quant_config=BLOCK_128)
        row = RowParallelLinear(512, 256, bias=False, quant_config=BLOCK_128)
        column = ColumnParallelLinear(256, 512, bias=False, quant_config=BLOCK_128)
    _load(merged, {0: gate, 1: up})
    _load(merged_fused, {None: fused})
    _load(qkv, {"q": q, "k": k, "v": v})
    _load(row, {None: down})
    _load(column, {None: gate})

    def deq(pair, dim: int = 0) -> torch.Tensor:
        return _half(dequantize_block_fp8(*pair, block), rank, dim)

    assert torch.equal(_dequantized(merged), torch.cat([deq(gate), deq(up)]))
    assert torch.equal(_dequantized(merged_fused), _dequantized(merged))
    assert torch.equal(_dequantized(qkv), torch.cat([deq(q), deq(k), deq(v)]))
    assert torch.equal(_dequantized(row), deq(down, dim=1))
    assert torch.equal(_dequantized(column), deq(gate))


def test_replicated_kv_heads_take_their_heads_block_scales():
    """4 ranks, 2 KV heads of 128: ranks 2 and 3 hold KV head 1, with its block row of scales."""
    gen = torch.Generator().manual_seed(2)
    block = (128, 128)
    q, k, v = (quantize_block_fp8(torch.randn(n, 128, generator=gen), block) for n in (512, 256, 256))
    with fake_tp_group(3, world_size=4):
        qkv = QKVParallelLinear(128, 128, 4, 2, bias=False, quant_config=BLOCK_128)
    _load(qkv, {"q": q, "k": k, "v": v})
    parts = [dequantize_block_fp8(*t, block) for t in (q, k, v)]
    assert torch.equal(_dequantized(qkv), torch.cat([parts[0][384:], parts[1][128:], parts[2][128:]]))


@pytest.mark.parametrize(
    "build,message",
    [
        # 192 rows a rank: the cut at row 192 splits a block.
        (lambda: ColumnParallelLinear(256, 384, bias=False, quant_config=BLOCK_128, prefix="m.up"), r"m\.up rows"),
        (lambda: RowParallelLinear(384, 256, bias=False, quant_config=BLOCK_128, prefix="m.down"), r"m\.down columns"),
        # gate's 256 rows a rank are whole blocks, but gate and up of 64 rows a rank are not.
        (
            lambda: MergedColumnParallelLinear(256, [128, 128], bias=False, quant_config=BLOCK_128, prefix="m.gate_up"),
            r"m\.gate_up \(part 0\) rows",
        ),
    ],
)
def test_cuts_off_block_boundaries_are_refused(build, message):
    with fake_tp_group(0), pytest.raises(ValueError, match=message + r".*tensor-parallel size 2"):
        build()


def test_a_fused_part_off_block_boundaries_is_refused_even_on_one_rank():
    """q of 64 rows then k: q's block would hold k's first rows; a lone layer of 64 rows is fine."""
    with pytest.raises(ValueError, match=r"qkv_proj \(part 'q'\) rows of the fused weight"):
        QKVParallelLinear(128, 16, 4, 2, bias=False, quant_config=BLOCK_128, prefix="l.qkv_proj")
    assert ReplicatedLinear(128, 64, bias=False, quant_config=BLOCK_128).weight_scale_inv.shape == (1, 1)


def test_scales_of_the_wrong_shape_are_refused():
    layer = ReplicatedLinear(256, 256, bias=False, quant_config=BLOCK_128, prefix="m.o_proj")
    with pytest.raises(ValueError, match=r"m\.o_proj: weight_scale_inv of shape \(2, 1\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(2, 1))


# ---- experts ------------------------------------------------------------------------------------

BLOCK_16 = Fp8Config(is_checkpoint_fp8=True, weight_block_size=(16, 16))


def _expert_tensors(num_experts: int, hidden: int, intermediate: int, block: tuple[int, int]) -> dict:
    gen = torch.Generator().manual_seed(3)
    return {
        (e, proj): quantize_block_fp8(torch.randn(*shape, generator=gen), block)
        for e in range(num_experts)
        for proj, shape in (
            ("w1", (intermediate, hidden)),
            ("w3", (intermediate, hidden)),
            ("w2", (hidden, intermediate)),
        )
    }


def _load_experts(layer: FusedMoE, tensors: dict, stacked: bool) -> None:
    params = (("weight", 0), ("weight_scale_inv", 1))
    if stacked:
        num_experts = 1 + max(e for e, _ in tensors)
        for suffix, i in params:
            w13 = torch.stack([torch.cat([tensors[e, "w1"][i], tensors[e, "w3"][i]]) for e in range(num_experts)])
            w2 = torch.stack([tensors[e, "w2"][i] for e in range(num_experts)])
            for shard_id, loaded in (("w13", w13), ("w2", w2)):
                param = getattr(layer, f"{shard_id}_{suffix}")
                param.weight_loader(param, loaded, shard_id)
    else:
        for (e, proj), pair in tensors.items():
            for suffix, i in params:
                param = getattr(layer, f"{'w2' if proj == 'w2' else 'w13'}_{suffix}")
                param.weight_loader(param, pair[i], proj, e)
    layer.process_weights_after_loading()


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize(("rank", "expert_parallel"), [(0, False), (1, False), (1, True)])
def test_expert_shards_and_forward(rank, expert_parallel, stacked):
    """8 experts, intermediate 64 in 16 x 16 blocks: tensor parallelism gives each rank 32 rows
    (two blocks) of every expert, expert parallelism 4 whole experts; either way the rank's
    dequantized weights are its slices of the checkpoint's, and its forward is the block-fp8
    reference on them (the partial sum of its experts and rows)."""
    hidden, intermediate, block = 48, 64, (16, 16)
    tensors = _expert_tensors(8, hidden, intermediate, block)
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        with fake_tp_group(rank):
            layer = FusedMoE(8, 2, hidden, intermediate, quant_config=BLOCK_16, prefix="m.experts")
    finally:
        parallel_state.set_expert_parallel(False)
    assert isinstance(layer.moe_method, Fp8BlockMoEMethod)
    _load_experts(layer, tensors, stacked)
    experts = range(4 * rank, 4 * rank + 4) if expert_parallel else range(8)
    rows = slice(None) if expert_parallel else slice(32 * rank, 32 * rank + 32)

    def deq(e: int, proj: str) -> torch.Tensor:
        return dequantize_block_fp8(*tensors[e, proj], block)

    w13 = torch.stack([torch.cat([deq(e, "w1")[rows], deq(e, "w3")[rows]]) for e in experts])
    w2 = torch.stack([deq(e, "w2")[:, rows] for e in experts])
    assert torch.equal(dequantize_block_fp8(layer.w13_weight, layer.w13_weight_scale_inv, block), w13)
    assert torch.equal(dequantize_block_fp8(layer.w2_weight, layer.w2_weight_scale_inv, block), w2)

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, hidden, generator=gen)
    topk_weights, topk_ids = torch.rand(6, 8, generator=gen).topk(2, dim=-1)
    out = layer(x, topk_weights, topk_ids)
    expected = fused_moe_block_fp8_ref(
        x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale_inv, layer.w2_weight_scale_inv,
        topk_weights, topk_ids, block, layer.expert_map,
    )  # fmt: skip
    assert torch.equal(out, expected)


def test_reference_rounds_both_expert_inputs():
    """fused_moe_block_fp8_ref is the float formula on the dequantized weights with the token's
    hidden state and each expert's silu(gate) * up rounded per group of block_k."""
    hidden, intermediate, block = 32, 32, (16, 16)
    tensors = _expert_tensors(2, hidden, intermediate, block)
    w13_q = torch.stack([torch.cat([tensors[e, "w1"][0], tensors[e, "w3"][0]]) for e in range(2)])
    w13_s = torch.stack([torch.cat([tensors[e, "w1"][1], tensors[e, "w3"][1]]) for e in range(2)])
    w2_q, w2_s = (torch.stack([tensors[e, "w2"][i] for e in range(2)]) for i in (0, 1))
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids = torch.tensor([[0.7, 0.3]] * 3), torch.tensor([[1, 0]] * 3)
    out = fused_moe_block_fp8_ref(x, w13_q, w2_q, w13_s, w2_s, topk_weights, topk_ids, block)
    w13, w2 = dequantize_block_fp8(w13_q, w13_s, block), dequantize_block_fp8(w2_q, w2_s, block)
    expected = torch.zeros(3, hidden)
    for j, e in enumerate((1, 0)):
        gate, up = F.linear(fake_quant_per_token_group(x, 16), w13[e]).chunk(2, dim=-1)
        expected += topk_weights[:, j : j + 1] * F.linear(fake_quant_per_token_group(F.silu(gate) * up, 16), w2[e])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_expert_cuts_off_block_boundaries_are_refused():
    with fake_tp_group(0), pytest.raises(ValueError, match=r"m\.experts: the gate/up rows \[0, 24\).*size 2"):
        FusedMoE(8, 2, 48, 48, quant_config=BLOCK_16, prefix="m.experts")
    with pytest.raises(ValueError, match="gate/up rows"):  # gate's last block would hold up's rows
        FusedMoE(8, 2, 48, 40, quant_config=BLOCK_16, prefix="m.experts")
