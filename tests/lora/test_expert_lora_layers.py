"""The LoRA form of `FusedMoE` (shoal/lora/expert_layers.py) without Ray: each tensor-parallel or
expert-parallel rank's share of an adapter's expert A and B gives partial sums that add up to
the single rank's output (what the MoE block's all-reduce does); quantized experts refuse expert
adapters."""

from __future__ import annotations

import pytest
import torch

from shoal.distributed import parallel_state
from shoal.layers.moe import FusedMoE
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.lora.expert_layers import ModelExperts, add_expert_lora
from shoal.lora.layers import TokenSlots
from tests.layers.tp_utils import fake_tp_group

E, TOP_K, HIDDEN, INTERMEDIATE, RANK = 4, 2, 16, 8, 4


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w13": torch.randn(E, 2 * INTERMEDIATE, HIDDEN, generator=g) * 0.3,
        "w2": torch.randn(E, HIDDEN, INTERMEDIATE, generator=g) * 0.3,
        "experts.gate_up_proj": (
            torch.randn(E, 3, HIDDEN, generator=g),
            torch.randn(E, 2 * INTERMEDIATE, 3, generator=g),
        ),
        "experts.down_proj": (torch.randn(E, 3, INTERMEDIATE, generator=g), torch.randn(E, HIDDEN, 3, generator=g)),
    }  # type: ignore[dict-item]


def _rank_output(rank: int, world_size: int, expert_parallel: bool, x, topk_weights, topk_ids, slots) -> torch.Tensor:
    checkpoint = _checkpoint()
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        with fake_tp_group(rank, world_size):
            layer = FusedMoE(E, TOP_K, HIDDEN, INTERMEDIATE)
            layer.weight_loader(layer.w13_weight, checkpoint["w13"], "w13")
            layer.weight_loader(layer.w2_weight, checkpoint["w2"], "w2")
            token_slots = TokenSlots.of(slots, 2)
            holders = add_expert_lora(layer, "experts", 2, RANK, token_slots, torch.float32)
            adapter = {k: v for k, v in checkpoint.items() if k.startswith("experts.")}
            for holder in holders:  # the adapter in slot 1, slot 0 empty
                lora_a, lora_b = holder.slot_tensors(adapter)  # type: ignore[arg-type]
                holder.lora_a[1].copy_(lora_a)
                holder.lora_b[1].copy_(lora_b)
            return layer(x, topk_weights, topk_ids)
    finally:
        parallel_state.set_expert_parallel(False)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_ranks_partial_sums_add_up_to_one_rank(expert_parallel: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, HIDDEN, generator=g)
    topk_weights, topk_ids = torch.rand(6, E, generator=g).topk(TOP_K, dim=-1)
    slots = torch.tensor([1, -1, 1, 0, 1, -1], dtype=torch.int32)
    args = (x, topk_weights, topk_ids, slots)
    whole = _rank_output(0, 1, False, *args)
    parts = sum(_rank_output(rank, 2, expert_parallel, *args) for rank in range(2))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    without_lora = _rank_output(0, 1, False, x, topk_weights, topk_ids, torch.full_like(slots, -1))
    assert torch.equal(whole[slots < 1], without_lora[slots < 1])  # slot 0 is empty, -1 the base
    assert not torch.allclose(whole[slots == 1], without_lora[slots == 1])


def test_quantized_experts_refuse_expert_adapters() -> None:
    block_fp8 = Fp8Config(is_checkpoint_fp8=True, weight_block_size=(16, 16))
    with fake_tp_group(0, 1):
        layer = FusedMoE(E, TOP_K, 32, 32, quant_config=block_fp8, prefix="mlp.experts")
    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": layer})})
    experts = ModelExperts(model, 2, RANK, TokenSlots.of(torch.full((4,), -1, dtype=torch.int32), 2), torch.float32)
    assert not experts.holders
    experts.check({"layers.0.self_attn.q_proj": (torch.zeros(2, 4), torch.zeros(4, 2))})  # the rest is served
    module = (torch.zeros(E, RANK, 32), torch.zeros(E, 64, RANK))
    with pytest.raises(
        ValueError, match=r"LoRA on the MoE experts of mlp\.experts is not supported with Fp8BlockMoEMethod"
    ):
        experts.check({"mlp.experts.gate_up_proj": module})
