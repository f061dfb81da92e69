from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tests.layers.tp_utils import fake_tp_group


def test_replicated_and_column_linear_tp1():
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(3, 8)
    for cls in (ReplicatedLinear, ColumnParallelLinear):
        layer = cls(8, 12, bias=True)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert torch.equal(layer(x), F.linear(x, w, b))


def test_parameters_are_inference_only():
    layer = ColumnParallelLinear(8, 4)
    assert not layer.weight.requires_grad and hasattr(layer.weight, "weight_loader")


@pytest.mark.parametrize("rank", [0, 1])
def test_column_parallel_shards_rows(rank):
    w, b = torch.randn(12, 8), torch.randn(12)
    with fake_tp_group(rank):
        layer = ColumnParallelLinear(8, 12, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    assert torch.equal(layer.weight, w[rank * 6 : (rank + 1) * 6])
    assert torch.equal(layer.bias, b[rank * 6 : (rank + 1) * 6])


@pytest.mark.parametrize("rank", [0, 1])
def test_merged_column_parallel_shards_each_output(rank):
    gate, up = torch.randn(10, 4), torch.randn(10, 4)
    with fake_tp_group(rank):
        layer = MergedColumnParallelLinear(4, [10, 10], bias=False)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    expected = torch.cat((gate[rank * 5 : (rank + 1) * 5], up[rank * 5 : (rank + 1) * 5]))
    assert torch.equal(layer.weight, expected)
    fused = MergedColumnParallelLinear(4, [10, 10], bias=False)  # tp 1: a checkpoint storing gate_up
    fused.weight.weight_loader(fused.weight, torch.cat((gate, up)))
    assert torch.equal(fused.weight, torch.cat((gate, up)))


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_qkv_parallel_shards_heads_and_replicates_kv(rank, num_kv_heads):
    num_heads, head_size, hidden, tp = 8, 3, 5, 4
    q = torch.randn(num_heads * head_size, hidden)
    k = torch.randn(num_kv_heads * head_size, hidden)
    v = torch.randn(num_kv_heads * head_size, hidden)
    with fake_tp_group(rank, world_size=tp):
        layer = QKVParallelLinear(hidden, head_size, num_heads, num_kv_heads, bias=False)
    for shard_id, w in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, w, shard_id)
    kv_heads_per_rank = max(1, num_kv_heads // tp)
    kv_head = rank * num_kv_heads // tp  # the first KV head this rank holds
    rows = slice(kv_head * head_size, (kv_head + kv_heads_per_rank) * head_size)
    expected = torch.cat((q[rank * 2 * head_size : (rank + 1) * 2 * head_size], k[rows], v[rows]))
    assert layer.num_kv_heads == kv_heads_per_rank
    assert torch.equal(layer.weight, expected)


def test_qkv_tp1_forward_and_fused_checkpoint():
    q, k, v = torch.randn(8, 6), torch.randn(4, 6), torch.randn(4, 6)
    bq, bk, bv = torch.randn(8), torch.randn(4), torch.randn(4)
    layer = QKVParallelLinear(6, 2, 4, 2, bias=True)
    for shard_id, w, b in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
        layer.weight.weight_loader(layer.weight, w, shard_id)
        layer.bias.weight_loader(layer.bias, b, shard_id)
    x = torch.randn(3, 6)
    assert torch.equal(layer(x), F.linear(x, torch.cat((q, k, v)), torch.cat((bq, bk, bv))))
    fused = QKVParallelLinear(6, 2, 4, 2, bias=False)
    fused.weight.weight_loader(fused.weight, torch.cat((q, k, v)))
    assert torch.equal(fused.weight, torch.cat((q, k, v)))


def test_row_parallel_partial_sums_add_up():
    """Each rank multiplies its slice of the input features; the sum of the ranks' outputs
    (what the all-reduce computes) is the full layer, with the bias counted once."""
    w, b, x = torch.randn(6, 10), torch.randn(6), torch.randn(3, 10)
    partials = []
    for rank in range(2):
        with fake_tp_group(rank):
            layer = RowParallelLinear(10, 6, bias=True, reduce_results=False)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert torch.equal(layer.weight, w[:, rank * 5 : (rank + 1) * 5])
        partials.append(layer(x[:, rank * 5 : (rank + 1) * 5]))
    torch.testing.assert_close(partials[0] + partials[1], F.linear(x, w, b))


def test_indivisible_sizes_fail_clearly():
    with fake_tp_group(0, world_size=3), pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(4, 10)
