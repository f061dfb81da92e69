"""Routing of every family against the Hugging Face routers it reproduces, on the same weights;
the layer-type rule against transformers' decoder layers; bad routing configs refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from shoal.layers.moe import MoEGate, RoutingConfig, is_moe_layer, num_routed_experts, select_experts

HIDDEN = 32


def _configs() -> dict[str, tuple[object, type]]:
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=3)
    return {
        "mixtral": (transformers.MixtralConfig(num_local_experts=8, **common), MixtralTopKRouter),
        "qwen2_moe": (transformers.Qwen2MoeConfig(num_experts=8, norm_topk_prob=False, **common), Qwen2MoeTopKRouter),
        "qwen3_moe": (transformers.Qwen3MoeConfig(num_experts=8, norm_topk_prob=True, **common), Qwen3MoeTopKRouter),
        "v2_greedy": (
            transformers.DeepseekV2Config(
                n_routed_experts=16, topk_method="greedy", routed_scaling_factor=1.5, **common
            ),
            DeepseekV2TopkRouter,
        ),
        "v2_group_limited": (
            transformers.DeepseekV2Config(
                n_routed_experts=16, topk_method="group_limited_greedy", n_group=4, topk_group=2, **common
            ),
            DeepseekV2TopkRouter,
        ),
        "v3_noaux_tc": (
            transformers.DeepseekV3Config(
                n_routed_experts=16, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, **common
            ),
            DeepseekV3TopkRouter,
        ),
    }


@pytest.mark.parametrize("family", list(_configs()))
def test_gate_matches_the_hf_router(family: str) -> None:
    hf_config, router_cls = _configs()[family]
    torch.manual_seed(0)
    hf_router = router_cls(hf_config)
    torch.nn.init.normal_(hf_router.weight, std=0.5)
    routing = RoutingConfig.from_hf_config(hf_config)
    gate = MoEGate(HIDDEN, routing, params_dtype=torch.float32)
    gate.weight.data.copy_(hf_router.weight)
    if routing.uses_correction_bias:
        # A bias large enough to change choices: the weights must still come from the raw scores.
        hf_router.e_score_correction_bias.normal_(std=0.3)
        gate.e_score_correction_bias.data.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(64, HIDDEN)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = gate(x)
    assert weights.dtype == torch.float32 and ids.shape == (64, 3)
    ours, theirs = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(ours.values, theirs.values)
    torch.testing.assert_close(weights.gather(1, ours.indices), hf_weights.float().gather(1, theirs.indices))


def test_correction_bias_changes_the_choice_not_the_weight() -> None:
    routing = RoutingConfig(4, 1, scoring_func="sigmoid", topk_method="noaux_tc", renormalize=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, routing, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.tensor([[-1.0]]).sigmoid())
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        select_experts(logits, routing)


def test_grouped_routing_chooses_only_from_the_best_groups() -> None:
    """Groups {0,1} {2,3} {4,5}; ungrouped, the top two are experts 4 and 2."""
    logits = torch.tensor([[2.5, 2.4, 2.6, -5.0, 3.0, -1.0]])
    assert sorted(select_experts(logits, RoutingConfig(6, 2))[1][0].tolist()) == [2, 4]
    # A group scores by its best expert: only group 2 (3.0) may be chosen from.
    greedy = RoutingConfig(6, 2, topk_method="group_limited_greedy", num_expert_groups=3, topk_groups=1)
    assert sorted(select_experts(logits, greedy)[1][0].tolist()) == [4, 5]
    # By the sum of its best two: groups 0 and 2 beat group 1, whose expert 2 is out.
    noaux = RoutingConfig(6, 2, "sigmoid", topk_method="noaux_tc", num_expert_groups=3, topk_groups=2)
    assert sorted(select_experts(logits, noaux, torch.zeros(6))[1][0].tolist()) == [0, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=6, top_k=2, topk_method="noaux_tc", num_expert_groups=4, topk_groups=1), "groups"),
        (dict(num_experts=8, top_k=2, topk_method="noaux_tc", num_expert_groups=4, topk_groups=5), "topk_group"),
        (dict(num_experts=8, top_k=5, topk_method="noaux_tc", num_expert_groups=4, topk_groups=2), "exceeds"),
        (dict(num_experts=8, top_k=2, topk_method="best"), "topk_method"),
        (dict(num_experts=8, top_k=2, scoring_func="tanh"), "scoring"),
    ],
)
def test_bad_routing_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


def test_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="no routing rule"):
        RoutingConfig.from_hf_config(transformers.LlamaConfig())


@pytest.mark.parametrize(
    "config",
    [
        transformers.Qwen2MoeConfig(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3, 5]),
        transformers.Qwen3MoeConfig(num_hidden_layers=6, mlp_only_layers=[0]),
        transformers.Qwen2MoeConfig(num_hidden_layers=3, num_experts=0),
        transformers.DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=2),
        transformers.DeepseekV2Config(num_hidden_layers=4, first_k_dense_replace=1),
        transformers.MixtralConfig(num_hidden_layers=3),
    ],
)
def test_moe_layers_are_those_transformers_builds(config) -> None:
    from transformers import AutoModelForCausalLM

    small = dict(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_attention_heads=2)
    small.update(num_key_value_heads=2, vocab_size=32, shared_expert_intermediate_size=8, head_dim=8)
    for key, value in small.items():
        setattr(config, key, value)
    if config.model_type.startswith("deepseek"):
        config.update(dict(q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))
        config.update(dict(n_group=1, topk_group=1))
    model = AutoModelForCausalLM.from_config(config)
    hf_moe = ["experts" in dict(layer.mlp.named_children()) for layer in model.model.layers]
    assert [is_moe_layer(config, i) for i in range(config.num_hidden_layers)] == hf_moe
    assert (num_routed_experts(config) > 0) == any(hf_moe)


def test_moe_layer_freq_skips_layers() -> None:
    config = transformers.DeepseekV2Config(num_hidden_layers=6, first_k_dense_replace=1)
    config.moe_layer_freq = 2  # the original DeepSeek code's key (every released config has 1)
    assert [is_moe_layer(config, i) for i in range(6)] == [False, False, True, False, True, False]
