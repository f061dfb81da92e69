"""The routed experts (`FusedMoE`, `fused_moe_ref`) and the MoE block against Hugging Face's
modules on the same weights; weight loading from both checkpoint layouts; tensor- and
expert-parallel shards whose partial sums add up to the whole layer."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as HFQwen2MoeBlock

from shoal.distributed import parallel_state
from shoal.kernels.fused_moe import fused_moe_ref
from shoal.layers.moe import ExpertPlacement, FusedMoE, expert_checkpoint_target
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.models.qwen_moe import Qwen2MoeSparseMoeBlock
from tests.layers.tp_utils import fake_tp_group

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 6, 2, 16, 12


def _stacked_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) as transformers stacks them."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.3
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.3
    return gate_up, down


def _per_expert_checkpoint(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(NUM_EXPERTS):
        gate, up = gate_up[e].chunk(2)
        tensors[f"m.experts.{e}.gate_proj.weight"] = gate.contiguous()
        tensors[f"m.experts.{e}.up_proj.weight"] = up.contiguous()
        tensors[f"m.experts.{e}.down_proj.weight"] = down[e].contiguous()
    return tensors


def _routing(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=generator)
    return x, weights, ids


def _load(layer: FusedMoE, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters(prefix="m.experts"))
    for name, tensor in tensors.items():
        param_name, shard_id, expert_id = expert_checkpoint_target(
            name, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        )
        params[param_name].weight_loader(params[param_name], tensor, shard_id, expert_id)


def test_reference_matches_hf_experts() -> None:
    config = transformers.MixtralConfig(
        num_local_experts=NUM_EXPERTS, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE
    )
    hf = MixtralExperts(config)
    gate_up, down = _stacked_weights()
    hf.gate_up_proj.data.copy_(gate_up)
    hf.down_proj.data.copy_(down)
    x, weights, ids = _routing(40)
    with torch.no_grad():
        expected = hf(x, ids, weights)
    torch.testing.assert_close(fused_moe_ref(x, gate_up, down, weights, ids), expected, rtol=0, atol=1e-6)


def test_both_checkpoint_layouts_load_the_same_weights() -> None:
    gate_up, down = _stacked_weights()
    per_expert, stacked = (
        FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE),
        FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE),
    )
    _load(per_expert, _per_expert_checkpoint(gate_up, down))
    _load(stacked, {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down})
    assert torch.equal(per_expert.w13_weight, gate_up) and torch.equal(stacked.w13_weight, gate_up)
    assert torch.equal(per_expert.w2_weight, down) and torch.equal(stacked.w2_weight, down)
    x, weights, ids = _routing(9)
    torch.testing.assert_close(per_expert(x, weights, ids), fused_moe_ref(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_two_ranks_partial_sums_add_up_to_the_layer(expert_parallel: bool, layout: str) -> None:
    """Tensor parallelism: each rank half of every expert's intermediate rows; expert
    parallelism: experts 0-2 on rank 0, 3-5 on rank 1. Either way the two partial outputs sum
    to the whole layer's (what the block's all-reduce computes)."""
    gate_up, down = _stacked_weights()
    checkpoint = (
        _per_expert_checkpoint(gate_up, down)
        if layout == "per_expert"
        else {"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}
    )
    x, weights, ids = _routing(25)
    partials = []
    for rank in range(2):
        with fake_tp_group(rank):
            layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, expert_parallel=expert_parallel)
        _load(layer, checkpoint)
        if expert_parallel:
            experts = slice(3 * rank, 3 * rank + 3)
            assert torch.equal(layer.w13_weight, gate_up[experts]) and torch.equal(layer.w2_weight, down[experts])
            assert layer.expert_map.tolist() == ([0, 1, 2, -1, -1, -1] if rank == 0 else [-1, -1, -1, 0, 1, 2])
        else:
            rows = slice(6 * rank, 6 * rank + 6)
            gate, up = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]
            assert torch.equal(layer.w13_weight, torch.cat([gate[:, rows], up[:, rows]], dim=1))
            assert torch.equal(layer.w2_weight, down[:, :, rows]) and layer.expert_map is None
        partials.append(layer(x, weights, ids))
    torch.testing.assert_close(partials[0] + partials[1], fused_moe_ref(x, gate_up, down, weights, ids))


def test_expert_parallel_follows_the_workers_setting() -> None:
    parallel_state.set_expert_parallel(True)
    try:
        with fake_tp_group(1, world_size=4):
            layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE)
    finally:
        parallel_state.set_expert_parallel(False)
    # 6 experts over 4 ranks: 2, 2, 1, 1.
    assert (layer.placement.first_expert, layer.num_local_experts) == (2, 2)
    with fake_tp_group(1, world_size=4):
        assert FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE).num_local_experts == NUM_EXPERTS


def test_placements() -> None:
    assert [ExpertPlacement.for_rank(7, 8, r, 3, True).local_experts for r in range(3)] == [
        slice(0, 3),
        slice(3, 5),
        slice(5, 7),
    ]
    placement = ExpertPlacement.for_rank(7, 8, 2, 3, True)
    assert placement.local_index(4) is None and placement.local_index(6) == 1
    with pytest.raises(ValueError, match="at least one expert per rank"):
        ExpertPlacement.for_rank(2, 8, 0, 4, True)
    with pytest.raises(ValueError, match="not divisible"):
        ExpertPlacement.for_rank(8, 10, 0, 4, False)


def test_checkpoint_names() -> None:
    mixtral = {"w1": "w1", "w3": "w3", "w2": "w2"}
    assert expert_checkpoint_target("a.mlp.experts.5.w3.weight", mixtral) == ("a.mlp.experts.w13_weight", "w3", 5)
    assert expert_checkpoint_target("a.mlp.experts.down_proj", mixtral) == ("a.mlp.experts.w2_weight", "w2", None)
    qwen = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    assert expert_checkpoint_target("a.experts.0.down_proj.weight_scale_inv", qwen) == (
        "a.experts.w2_weight_scale_inv",
        "w2",
        0,
    )
    assert expert_checkpoint_target("a.shared_expert.gate_proj.weight", qwen) is None
    assert expert_checkpoint_target("a.experts.0.w1.weight", qwen) is None


def test_quantized_experts_are_refused() -> None:
    with pytest.raises(ValueError, match="not supported for the experts"):
        FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, quant_config=Fp8Config(), prefix="m.experts")


def test_unknown_shard_ids_are_refused() -> None:
    layer = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE)
    with pytest.raises(ValueError, match="shard id"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTERMEDIATE, HIDDEN), "w4", 0)
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w13_weight, torch.zeros(NUM_EXPERTS, INTERMEDIATE, HIDDEN), "w13")


def test_qwen2_block_with_its_shared_expert_matches_hf() -> None:
    config = transformers.Qwen2MoeConfig(
        hidden_size=HIDDEN,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTERMEDIATE,
        shared_expert_intermediate_size=20,
        norm_topk_prob=False,
    )
    torch.manual_seed(0)
    hf = HFQwen2MoeBlock(config)
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.3)
    ours = Qwen2MoeSparseMoeBlock(config, None, "model.layers.0.mlp")
    state = {f"model.layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}
    params = dict(ours.named_parameters(prefix="model.layers.0.mlp"))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        param_name, shard_id, expert_id = expert_checkpoint_target(name, {})
        params[param_name].weight_loader(params[param_name], state[name], shard_id, expert_id)
    # Shared expert: gate and up rows into the merged projection, the rest one to one.
    shared = "model.layers.0.mlp.shared_expert"
    merged = params[f"{shared}.gate_up_proj.weight"]
    merged.weight_loader(merged, state[f"{shared}.gate_proj.weight"], 0)
    merged.weight_loader(merged, state[f"{shared}.up_proj.weight"], 1)
    for name in (
        f"{shared}.down_proj.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        params[name].data.copy_(state[name])
    x = torch.randn(1, 30, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=0, atol=1e-5)
